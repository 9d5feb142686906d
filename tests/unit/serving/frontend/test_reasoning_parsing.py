"""The reasoning parsers (qwen3, deepseek_r1), alone and in front of a tool-call parser: the reasoning,
the content and the reasoning-token count, whole and streamed in random pieces."""

from __future__ import annotations

import random

import pytest

from serving.frontend import reasoning
from serving.frontend.output_parsing import ParsingSpec
from serving.frontend.tool_parsers import get


def run(
    text: str,
    kind: str,
    thinking: bool = True,
    tools: str | None = None,
    seed: int | None = None,
    tokens: list[int] | None = None,
):
    """Feed `text` (in random pieces with a seed; one token per piece) → (reason, streamed fields, answer,
    reasoning tokens)."""
    p = ParsingSpec(reasoning=kind, thinking=thinking, tools=get(tools) if tools else None).start()
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 4) if seed is not None else len(text)
        pieces.append(text[i : i + k])
        i += k
    got: dict = {"reasoning_content": "", "content": "", "tool_calls": []}

    def take(delta: dict) -> None:
        for k, v in delta.items():
            if k != "tool_calls":
                got[k] += v
        for call in delta.get("tool_calls", []):
            if call["index"] < len(got["tool_calls"]):
                got["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            else:
                got["tool_calls"].append(call)

    for n, piece in enumerate(pieces):
        p.feed(piece, tokens[n] if tokens else 1)
        take(p.drain())
    reason = p.finish("stop")
    take(p.drain())
    return reason, got, p.result, p.reasoning_tokens


@pytest.mark.parametrize("kind", reasoning.KINDS)
@pytest.mark.parametrize("seed", [None, *range(8)])
def test_thinking_then_answer(kind, seed):
    _, got, answer, _ = run("<think>\nFirst, 2+2.\n</think>\n\nIt is 4.", kind, seed=seed)
    assert (answer.reasoning, answer.content) == ("\nFirst, 2+2.\n", "It is 4.")
    assert (got["reasoning_content"], got["content"]) == ("\nFirst, 2+2.\n", "It is 4.")


def test_deepseek_r1_starts_thinking_and_qwen3_needs_the_tag():
    _, _, r1, r1_tokens = run("no tag here</think>answer", "deepseek_r1", tokens=[5])
    assert (r1.reasoning, r1.content, r1_tokens) == ("no tag here", "answer", 5)
    _, _, q3, q3_tokens = run("no tag here</think>answer", "qwen3", tokens=[5])
    assert (q3.reasoning, q3.content, q3_tokens) == (None, "no tag here</think>answer", 0)
    _, _, unclosed, _ = run("thinking until the end", "deepseek_r1")
    assert (unclosed.reasoning, unclosed.content) == ("thinking until the end", None)


def test_thinking_turned_off_reads_content():
    _, got, answer, n = run("Just the answer.", "deepseek_r1", thinking=False, seed=3)
    assert (answer.reasoning, answer.content, n) == (None, "Just the answer.", 0) and got["reasoning_content"] == ""
    _, _, opened, _ = run("<think>x</think>y", "deepseek_r1", thinking=False)  # unless it opens the tag itself
    assert (opened.reasoning, opened.content) == ("x", "y")
    assert not reasoning.thinking_requested({"enable_thinking": False})
    assert not reasoning.thinking_requested({"thinking": False}) and reasoning.thinking_requested({})


def test_reasoning_tokens_count_the_outputs_until_the_end_of_thinking():
    """Counted per output (one token each while decoding): up to the one that completes `</think>`."""
    p = ParsingSpec(reasoning="qwen3").start()
    for text, n in (("<thi", 1), ("nk>a b", 2), (" c</th", 2), ("ink>\n\nThe", 2), (" answer", 1)):
        p.feed(text, n)
    p.finish("stop")
    assert p.reasoning_tokens == 7 and p.result.content == "The answer"


@pytest.mark.parametrize("seed", range(8))
def test_reasoning_then_a_tool_call(seed):
    text = '<think>I should call f.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>'
    reason, got, answer, _ = run(text, "qwen3", tools="hermes", seed=seed)
    assert reason == "tool_calls" and answer.reasoning == got["reasoning_content"] == "I should call f."
    assert answer.content is None and got["content"] == ""
    assert [c["function"] for c in got["tool_calls"]] == [{"name": "f", "arguments": '{"q": "x"}'}]
    assert got["tool_calls"][0]["id"] == answer.tool_calls[0]["id"]


def test_a_dropped_marker_never_reaches_the_answer():
    p = ParsingSpec(tools=get("mistral"), drop="</s>").start()
    for piece in ('[TOOL_CALLS][{"name": "f", "arguments": {}}]', "</", "s>"):
        p.feed(piece, 1)
    assert p.finish("stop") == "tool_calls" and p.result.tool_calls[0]["function"]["arguments"] == "{}"
