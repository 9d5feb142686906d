"""The Messages API's answers: the `message` body and its SSE events, from a chat answer.

A streamed answer is a sequence of content blocks, each opened (`content_block_start`), grown
(`content_block_delta`: `text_delta`, `input_json_delta` for a tool call's arguments,
`thinking_delta`) and closed (`content_block_stop`), between `message_start` (+ `ping`) and
`message_delta` (stop reason, usage) + `message_stop`; every event is `event: <type>` + `data:`.
The deltas are the chat route's (`OutputParsing.drain`: `reasoning_content`, `content`,
`tool_calls`), so a block's text is exactly what the chat route would have streamed.

Usage is Anthropic's: `input_tokens` are the prompt tokens the prefix cache did not serve,
`cache_read_input_tokens` those it did (their sum is the chat route's `prompt_tokens`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from serving.frontend.errors import APIError, anthropic_body
from serving.frontend.output_parsing import ParsedAnswer
from telemetry.outcomes import TOOL_CALLS

STOP_REASONS = {"length": "max_tokens", TOOL_CALLS: "tool_use"}  # any other finish: end_turn
_json = msgspec.json.Encoder()


def event(kind: str, obj: dict) -> bytes:
    """One SSE event with its name, as Anthropic's stream frames them."""
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def stop_reason(finish: str | None, matched: str | int | None, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string the request named is `stop_sequence`."""
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "", "end_turn"), None


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use(call: dict) -> dict:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn.get("arguments", ""))}


def content(text: str, answer: ParsedAnswer | None) -> list[dict]:
    """A whole answer's blocks: thinking (with a reasoning parser), text, then one tool_use per call."""
    if answer is None:
        return [{"type": "text", "text": text}]
    blocks: list[dict] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content or not answer.tool_calls:
        blocks.append({"type": "text", "text": answer.content or ""})
    return blocks + [tool_use(c) for c in answer.tool_calls]


class MessageShape:
    """One response's body, or its events as the answer streams."""

    def __init__(self, msg_id: str, model: str, stops: list[str]) -> None:
        self.id, self.model, self.stops = msg_id, model, stops
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.call = -1  # the chat delta's index of the open tool call

    def message(self, blocks: list[dict], reason: str | None, sequence: str | None, use: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": use,
        }

    def start(self, use: dict) -> bytes:
        return event("message_start", {"type": "message_start", "message": self.message([], None, None, use)}) + event(
            "ping", {"type": "ping"}
        )

    def _block(self, kind: str, block: dict) -> bytes:
        """Close the open block if it is another, open `block`."""
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return out + event(
            "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, d: dict[str, Any]) -> bytes:
        """A chat delta's fields as events (empty when it carries nothing)."""
        out = b""
        if d.get("reasoning_content"):
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]})
        if d.get("content"):
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": d["content"]})
        for call in d.get("tool_calls") or ():
            if self.open != "tool_use" or call["index"] != self.call:
                self.call = call["index"]
                out += self._block(
                    "tool_use",
                    {
                        "type": "tool_use",
                        "id": call.get("id", ""),
                        "name": call["function"].get("name", ""),
                        "input": {},
                    },
                )
            if call["function"].get("arguments"):
                out += self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
        return out

    def finish(self, reason: str, sequence: str | None, use: dict, breakdown: dict | None) -> bytes:
        """The last events: the open block closed (an empty text block if none was opened), the stop reason and
        usage (with the server's latency breakdown, `sightline`), message_stop."""
        out = self._block("text", {"type": "text", "text": ""}) if self.index < 0 else b""
        out += self._close()
        end = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": use}
        if breakdown:
            end["sightline"] = breakdown
        return out + event("message_delta", end) + event("message_stop", {"type": "message_stop"})


def error_event(err: APIError) -> bytes:
    """An error after the stream started: Anthropic's `error` event."""
    return event("error", anthropic_body(err.status, err.message))
