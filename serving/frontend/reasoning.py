"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>…</think>` told apart from
its answer, for `reasoning_content` and `usage.completion_tokens_details.reasoning_tokens`.

- `qwen3`: the answer thinks when it opens with `<think>` (Qwen3 writes the tag itself; with
  `enable_thinking: false` its template closes an empty block in the prompt and the answer is all
  content).
- `deepseek_r1`: the template opened `<think>` in the prompt, so the answer starts thinking (a
  leading `<think>` is dropped) unless the request turned thinking off (`chat_template_kwargs`
  `enable_thinking` or `thinking` false) and the answer does not open the tag itself.

Either way the reasoning ends at `</think>` (an answer that never closes it is all reasoning) and
the content after it is left-stripped.  `split` reads the whole text so far; the text it returns
while streaming is always a prefix of what the whole answer gives (a half-written tag is held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
KINDS = ("qwen3", "deepseek_r1")


@dataclass
class Split:
    reasoning: str
    content: str
    thinking: bool | None  # the answer thinks; None while its first characters leave it open
    closed: bool = False  # `</think>` was written (or it does not think)


def held(text: str, marker: str) -> str:
    """`text` less a trailing half-written `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def thinking_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the template was asked to think: not when `enable_thinking` or `thinking` is false."""
    return kwargs.get("enable_thinking", True) is not False and kwargs.get("thinking", True) is not False


def split(kind: str, thinking: bool, text: str, final: bool) -> Split:
    """The reasoning and the content of `text` (the answer so far; all of it when `final`)."""
    lead = len(text) - len(text.lstrip())
    rest = text[lead:]
    if rest.startswith(START):
        body = lead + len(START)
    elif not final and START.startswith(rest):
        return Split("", "", None)  # empty, or half the tag
    elif kind == "deepseek_r1" and thinking:
        body = 0
    else:
        return Split("", text, False, True)
    end = text.find(END, body)
    if end < 0:
        return Split(text[body:] if final else held(text[body:], END), "", True)
    return Split(text[body:end], text[end + len(END) :].lstrip(), True, True)
