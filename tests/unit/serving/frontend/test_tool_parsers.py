"""The tool-call parsers, whole and streamed: each format's calls and content, text that only looks
like a call, and streams fed in random small pieces whose deltas must add up to the whole answer
(content, each call's name once, its arguments' pieces concatenating to its final `arguments`)."""

from __future__ import annotations

import json
import random

import pytest

from serving.frontend.output_parsing import ParsingSpec
from serving.frontend.tool_parsers import PARSERS, detect, get

WEATHER = {"city": 'Pa"ris }', "days": [1, {"x": "]"}], "ok": True, "t": -1.5e3}
ANSWERS = {  # a text in each format with two calls and the content it carries
    "hermes": (
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "now", "parameters": {}}',
        None,
    ),
    "mistral": (
        'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "now", "arguments": {}}]',
        "Sure.",
    ),
}


def parse(parser: str, text: str, max_calls: int | None = None, on_failure=None):
    p = ParsingSpec(tools=get(parser), max_calls=max_calls).start(on_failure)
    p.feed(text, 1)
    return p.finish("stop"), p.result


def stream(parser: str, text: str, seed: int, reasoning: str | None = None, max_calls: int | None = None):
    """(finish reason, content, reasoning, calls by index: [name, arguments], the whole answer) from random
    pieces of 1-5 characters; also checks the OpenAI delta shape."""
    rng = random.Random(seed)
    p = ParsingSpec(reasoning=reasoning, tools=get(parser) if parser else None, max_calls=max_calls).start()
    deltas, i = [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        p.feed(text[i : i + k], 1)
        deltas.append(p.drain())
        i += k
    reason = p.finish("stop")
    deltas.append(p.drain())
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:
                assert c["id"] and c["type"] == "function" and c["function"]["name"], c  # the first delta
                calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}, c
                calls[c["index"]][1] += c["function"]["arguments"]
    content = "".join(d.get("content", "") for d in deltas)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    return reason, content, thought, calls, p.result


@pytest.mark.parametrize("parser", PARSERS)
def test_each_format_whole(parser):
    text, content = ANSWERS[parser]
    reason, answer = parse(parser, text)
    assert reason == "tool_calls" and answer.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.tool_calls] == [
        ("get_weather", WEATHER),
        ("now", {}),
    ]
    ids = [c["id"] for c in answer.tool_calls]
    assert len(set(ids)) == 2 and all(c["type"] == "function" for c in answer.tool_calls)
    assert (
        all(len(i) == 9 and i.isalnum() for i in ids)
        if parser == "mistral"
        else all(i.startswith("call_") for i in ids)
    )
    _, one = parse(parser, text, max_calls=1)  # parallel_tool_calls false keeps the first
    assert [c["function"]["name"] for c in one.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("seed", range(12))
def test_each_format_streamed_in_random_pieces(parser, seed):
    text, _ = ANSWERS[parser]
    reason, content, _, calls, answer = stream(parser, text, seed)
    assert reason == "tool_calls" and (content or None) == answer.content
    final = [[c["function"]["name"], c["function"]["arguments"]] for c in answer.tool_calls]
    assert [calls[i] for i in sorted(calls)] == final
    _, _, _, one, _ = stream(parser, text, seed, max_calls=1)
    assert list(one) == [0]


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", "Plain answer with <b>tags</b> and a <tool_call"),
        ("hermes", "An answer.\n\n"),
        ("llama3_json", "The answer is 42. {not a call}"),
        ("mistral", "No calls [TOOL here."),
    ],
)
def test_text_without_calls_is_content_whole_and_streamed(parser, text):
    failures = []
    reason, answer = parse(parser, text, on_failure=lambda *a: failures.append(a))
    assert reason == "stop" and answer.content == text and answer.tool_calls == [] and failures == []
    for seed in range(5):
        reason, content, _, calls, _ = stream(parser, text, seed)
        assert reason == "stop" and content == text and calls == {}


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", 'Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}'),  # unfinished
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
        ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # arguments not an object
        ("hermes", "<tool_call>\nget_weather(city=Paris)\n</tool_call>"),  # not JSON
        ("llama3_json", '{"name": "f", "parameters": {"a": tru}}'),
        ("mistral", "[TOOL_CALLS] [oops]"),
    ],
)
def test_a_call_that_does_not_parse_is_content_and_reported(parser, text):
    failures = []
    reason, answer = parse(parser, text, on_failure=lambda *a: failures.append(a))
    assert reason == "stop" and answer.content == text and answer.tool_calls == []
    assert failures == [(parser, text)]
    for seed in range(5):  # the content deltas are the whole text (even when part of it also went out as a call)
        reason, content, _, _, _ = stream(parser, text, seed)
        assert reason == "stop" and content == text


def test_a_call_cut_by_length_is_not_a_parse_failure_and_complete_calls_are_kept():
    failures = []
    p = ParsingSpec(tools=get("hermes")).start(lambda *a: failures.append(a))
    p.feed('<tool_call>\n{"name": "f", "arguments": {"a": ', 3)
    assert p.finish("length") == "length" and failures == [] and p.result.tool_calls == []
    p = ParsingSpec(tools=get("hermes")).start(lambda *a: failures.append(a))
    p.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "ar', 9)
    assert p.finish("length") == "length" and failures == []
    assert [c["function"] for c in p.result.tool_calls] == [{"name": "f", "arguments": '{"a": 1}'}]


def test_arguments_written_as_a_json_string_and_other_key_orders():
    _, answer = parse("hermes", '<tool_call>{"arguments": "{\\"a\\": 1}", "name": "f"}</tool_call>')
    assert answer.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    _, answer = parse("llama3_json", '  {"name": "f", "arguments": {"b": 2}}\n\nThat is the call.')
    assert answer.tool_calls[0]["function"] == {"name": "f", "arguments": '{"b": 2}'} and answer.content is None
    _, answer = parse("hermes", '<tool_call>{"name": "f"}</tool_call>')  # no arguments: none
    assert answer.tool_calls[0]["function"]["arguments"] == "{}"


def test_llama3_holds_a_json_start_until_it_knows():
    p = ParsingSpec(tools=get("llama3_json")).start()
    p.feed("  <|python", 1)
    assert p.drain() == {}
    p.feed('_tag|>{"name": "f", "parameters": {"x"', 1)
    first = p.drain()["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": '{"x"'}
    p.feed(": 1}}", 1)
    assert p.drain()["tool_calls"] == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert p.finish("stop") == "tool_calls"


def test_auto_detection_from_the_chat_template():
    assert detect("{% if tools %}<tool_call>{% endif %}")[0] == "hermes"
    assert detect("<|start_header_id|>ipython<|end_header_id|>")[0] == "llama3_json"
    assert detect("{{ '[TOOL_CALLS]' }}<tool_call>")[0] == "mistral"
    assert detect(None) == ("hermes", "no known sign in the chat template: the default")
