"""One chat choice's answer as the client sees it: reasoning, content and tool calls, read from the
model's text as it arrives.

The TokenizerManager feeds each output's text to the choice's `OutputParsing` as it handles it
(in order, once) and asks it at the end for the finish reason to count (`tool_calls` when a stop's
answer parsed as calls), so the metrics and the flight recorder see what the client is told.
The HTTP side takes what is new with `drain` (the stream's next delta) or the whole answer from
`result`.  The text goes through the reasoning parser, then the content through the tool-call
parser; both re-read the whole text at each step, so what a stream sent is a prefix of the whole
answer (tests/unit/serving/test_tool_parsers.py feeds random pieces and checks it).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from serving.frontend import reasoning, tool_parsers
from serving.frontend.tool_parsers import ToolCallStream, ToolParser
from telemetry.outcomes import TOOL_CALLS

log = logging.getLogger(__name__)
MARKERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")  # the formats' literals that may be special tokens


def template_text(template: Any) -> str:
    """A chat template's text (a tokenizer may hold several by name: the tool-use one first)."""
    if isinstance(template, dict):
        return str(template.get("tool_use") or template.get("default") or "")
    return template if isinstance(template, str) else ""


def special_ids(tokenizer: Any, texts: tuple[str, ...]) -> dict[str, int]:
    """The texts among `texts` that are one special token of `tokenizer`, with their ids."""
    found = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for text in texts:
        for tid, tok in decoder.items():
            if getattr(tok, "content", None) == text and getattr(tok, "special", False):
                found[text] = tid
    return found


@dataclass(frozen=True)
class ParsingConfig:
    """The server's output parsers (`--tool-call-parser`, `--reasoning-parser`) and what they need of the
    tokenizer; read once at start."""

    tool_parser: str | None = None  # tool_parsers.PARSERS' name, or None (`none`)
    reasoning: str | None = None  # reasoning.KINDS' name, or None
    think_end_ids: tuple[int, ...] = ()  # `</think>`'s token ids: a constraint starts after them
    specials: dict[str, int] = field(default_factory=dict)  # format literals that are special tokens
    eos_text: str = ""

    @classmethod
    def load(cls, args: Any, tokenizer: Any, template: str | None) -> "ParsingConfig":
        choice = getattr(args, "tool_call_parser", "auto")
        kind = getattr(args, "reasoning_parser", "none")
        name = None if choice == "none" else choice
        if choice == "auto":
            name, why = tool_parsers.detect(template or template_text(getattr(tokenizer, "chat_template", None)))
            log.info("tool-call parser: %s (--tool-call-parser auto: %s)", name, why)
        ids: tuple[int, ...] = ()
        if kind != "none":
            ids = tuple(tokenizer(reasoning.END, add_special_tokens=False)["input_ids"])
        return cls(
            name,
            None if kind == "none" else kind,
            ids,
            special_ids(tokenizer, MARKERS),
            getattr(tokenizer, "eos_token", None) or "",
        )

    def marker(self, text: str) -> str:
        """`text` in a forced grammar: its special token by id when it is one, else the string."""
        return f"<[{self.specials[text]}]>" if text in self.specials else json.dumps(text)

    def keeps_specials(self) -> bool:
        """The format's marker is a special token, which the Detokenizer would drop (Mistral's
        `[TOOL_CALLS]`): such requests keep special tokens, and the answer drops the EOS."""
        return self.tool_parser == "mistral" and "[TOOL_CALLS]" in self.specials


@dataclass(frozen=True)
class ParsingSpec:
    """How a chat request's answers are read: built by the route, one `OutputParsing` per choice."""

    reasoning: str | None = None  # reasoning.KINDS, or None
    thinking: bool = True  # the template was asked to think (chat_template_kwargs)
    tools: ToolParser | None = None  # None: no tool calls are read (no tools, or tool_choice none)
    max_calls: int | None = None  # 1 without parallel_tool_calls
    drop: str = ""  # text removed from the answer: the EOS a mistral request keeps special tokens for

    def start(self, on_failure: Callable[[str, str], None] | None = None) -> "OutputParsing":
        return OutputParsing(self, on_failure)


@dataclass
class ParsedAnswer:
    content: str | None
    reasoning: str | None  # None without a reasoning parser, or when the answer did not think
    tool_calls: list[dict]


class OutputParsing:
    def __init__(self, spec: ParsingSpec, on_failure: Callable[[str, str], None] | None) -> None:
        self.spec = spec
        self.on_failure = on_failure  # (parser, text): a call that did not parse
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0  # characters of the content passed on (to the tool-call stream, or as deltas)
        self.calls = ToolCallStream(spec.tools, spec.max_calls) if spec.tools is not None else None
        self.closed = spec.reasoning is None  # the reasoning ended (or there is none)
        self.reasoning_tokens = 0
        self.pending: dict = {}
        self.result: ParsedAnswer | None = None  # once finished
        self._split = reasoning.Split("", "", None)

    # -- the TokenizerManager's side --------------------------------------------------
    def feed(self, text: str, tokens: int) -> None:
        """One output of the request: its text and how many tokens it carried."""
        thinking_before = not self.closed
        self.text += text
        self._update(False)
        if thinking_before and self._split.thinking is not False:
            self.reasoning_tokens += tokens

    def finish(self, reason: str) -> str:
        """The request ended with `reason` (the engine's): the finish reason the client is told."""
        try:
            self._update(True, reason == "length")
        except Exception:
            log.exception("output parsing failed; the answer is returned as text")
            self.result = ParsedAnswer(self.text, None, [])
            return reason
        final = self.calls.final if self.calls is not None else None
        calls = self.calls.tool_calls() if self.calls is not None else []
        sp = self._split
        if final is not None and final.failed and reason == "stop" and self.on_failure is not None:
            self.on_failure(self.spec.tools.name, final.content)
        content = final.content if final is not None else sp.content
        thought = sp.reasoning if sp.thinking else None
        if (calls or thought) and not content:
            content = None
        self.result = ParsedAnswer(content, thought if self.spec.reasoning else None, calls)
        return TOOL_CALLS if calls and reason == "stop" else reason

    # -- the HTTP side --------------------------------------------------------------------
    def drain(self) -> dict:
        """What is new since the last call, as a chat delta's fields (empty when nothing is)."""
        out, self.pending = self.pending, {}
        return out

    # -----------------------------------------------------------------------------------
    def _visible(self, final: bool) -> str:
        drop, text = self.spec.drop, self.text
        if not drop:
            return text
        text = text.replace(drop, "")
        return text if final else reasoning.held(text, drop)

    def _update(self, final: bool, truncated: bool = False) -> None:
        text = self._visible(final)
        if self.spec.reasoning is None:
            sp = reasoning.Split("", text, False, True)
        else:
            sp = reasoning.split(self.spec.reasoning, self.spec.thinking, text, final)
            if sp.thinking is False:
                self.reasoning_tokens = 0  # what was undecided turned out to be content
        self._split, self.closed = sp, sp.closed
        self._add("reasoning_content", sp.reasoning[self.sent_reasoning :])
        self.sent_reasoning = max(self.sent_reasoning, len(sp.reasoning))
        piece = sp.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(sp.content))
        if self.calls is None:
            self._add("content", piece)
            return
        content, deltas = self.calls.feed(piece)
        if final:
            more, rest = self.calls.finish(truncated)
            content, deltas = content + more, deltas + rest
        self._add("content", content)
        for d in deltas:
            self._add_call(d)

    def _add(self, key: str, text: str) -> None:
        if text:
            self.pending[key] = self.pending.get(key, "") + text

    def _add_call(self, delta: dict) -> None:
        calls = self.pending.setdefault("tool_calls", [])
        if calls and calls[-1]["index"] == delta["index"]:  # one entry per call in one delta
            fn = calls[-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + delta["function"]["arguments"]
        else:
            calls.append({**delta, "function": dict(delta["function"])})
