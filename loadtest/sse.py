"""Incremental SSE parsing and the per-request reading of an OpenAI stream (or an Anthropic Messages one).

`SSEParser` takes bytes as the socket delivers them: an event may be split anywhere
(even inside a UTF-8 character or between `\\r` and `\\n`), so lines are cut on bytes
and decoded only when whole.  `StreamReader` turns the events of one response into a
`RequestRecord`: TTFT at the first chunk that carries text (the chat role chunk carries
none and comes before any token), one chunk time per text chunk, usage (with
`prompt_tokens_details.cached_tokens`), finish reason, and why it failed (error event, invalid JSON, no `[DONE]`).
A Messages stream (`/v1/messages`, replayed) ends with `message_stop` instead of `[DONE]`, its usage and stop
reason in `message_delta`.
A /v1/responses stream (typed events, no `[DONE]`: it ends with `response.completed`, `.incomplete` or
`.failed`) is read into the same record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from loadtest.records import RequestRecord


@dataclass(frozen=True)
class SSEEvent:
    kind: str  # "data" (a dispatched event's data lines, joined by \n) | "comment" (a keep-alive)
    value: str


class SSEParser:
    """The WHATWG event-stream rules we need: `data:` lines, `:` comments, blank-line dispatch."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._after_cr = False  # the previous chunk ended in \r: a leading \n belongs to it

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        self._buf += chunk
        lines = self._buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._buf = lines.pop()  # the incomplete tail (b"" when the chunk ended a line)
        events: list[SSEEvent] = []
        for raw in lines:
            ev = self._line(raw.decode("utf-8"))
            if ev is not None:
                events.append(ev)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return SSEEvent("data", data)
        if line.startswith(":"):
            return SSEEvent("comment", line[1:].strip())
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id:, retry: are not used by this API

    @property
    def pending(self) -> bool:
        """Bytes or data lines not yet dispatched: a stream that ends here was cut mid-event."""
        return bool(self._buf.strip() or self._data)


# The error type of a mid-stream error event → the HTTP status it stands for (docs/api.md); OpenAI's, Anthropic's.
ERROR_EVENT_STATUS = {
    "internal_error": 500,
    "server_unavailable": 503,
    "timeout": 504,
    "api_error": 500,
    "overloaded_error": 503,
    "timeout_error": 504,
}
# Anthropic's stop reasons (POST /v1/messages) as finish reasons
ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "stop", "max_tokens": "length"}


def anthropic_usage(rec: RequestRecord, use: dict) -> None:
    """Anthropic's usage: the prompt is its uncached input plus what the cache read."""
    cached = use.get("cache_read_input_tokens") or 0
    rec.prompt_tokens, rec.cached_tokens = (use.get("input_tokens") or 0) + cached, cached
    rec.completion_tokens = use.get("output_tokens")


class StreamReader:
    """Reads one OpenAI streaming response (chat or completions) into a RequestRecord."""

    def __init__(self, record: RequestRecord, sent_at: float) -> None:
        self.rec = record
        self.sent_at = sent_at  # perf_counter() when the request was sent
        self.parser = SSEParser()
        self.done = False
        self.comments = 0

    def feed(self, chunk: bytes, now: float) -> None:
        for ev in self.parser.feed(chunk):
            if ev.kind == "comment":
                self.comments += 1
            elif not self.done:
                self._event(ev.value, now - self.sent_at)

    def _fail(self, reason: str, finish_reason: str = "error") -> None:
        if self.rec.error is None:
            self.rec.error = reason
            self.rec.finish_reason = finish_reason

    def _event(self, data: str, t: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self._fail("broken stream: invalid JSON in an event")
            return
        kind = obj.get("type")
        if kind in ("message_start", "content_block_delta", "message_delta", "message_stop"):  # /v1/messages
            self._anthropic(obj, t)
            return
        if isinstance(kind, str) and (kind.startswith("response.") or "error" not in obj):  # /v1/responses
            self._response_event(obj, t)
            return
        if "error" in obj:
            err = obj["error"] or {}
            kind = err.get("type") or "internal_error"
            # count it as the server does: an engine error is `error` (500); a request the server gave
            # up on (shutdown, engine restart: 503; its own timeout: 504) is `abort`
            self.rec.status = ERROR_EVENT_STATUS.get(kind, 500)
            self._fail(f"error event: {err.get('code') or kind}", "error" if self.rec.status == 500 else "abort")
            return
        if obj.get("usage"):
            usage = obj["usage"]
            self.rec.prompt_tokens = usage.get("prompt_tokens")
            self.rec.completion_tokens = usage.get("completion_tokens")
            self.rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in obj.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            finish = choice.get("finish_reason")
            if text:
                self.rec.chunk_times.append(t)
            if (text or finish) and self.rec.ttft is None:
                self.rec.ttft = t
            if finish:
                self.rec.finish_reason = finish

    def _anthropic(self, obj: dict, t: float) -> None:
        """An event of Anthropic's Messages stream: a delta's text (any block), the stop and usage, the end."""
        kind = obj["type"]
        if kind == "message_stop":
            self.done = True
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("text") or delta.get("partial_json") or delta.get("thinking"):
                self.rec.chunk_times.append(t)
                if self.rec.ttft is None:
                    self.rec.ttft = t
        elif kind == "message_delta":
            anthropic_usage(self.rec, obj.get("usage") or {})
            self.rec.finish_reason = ANTHROPIC_FINISH.get((obj.get("delta") or {}).get("stop_reason"), "abort")

    def _response_event(self, obj: dict, t: float) -> None:
        """One typed event of a /v1/responses stream."""
        kind = obj["type"]
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.rec.chunk_times.append(t)
            if self.rec.ttft is None:
                self.rec.ttft = t
        elif kind in ("response.completed", "response.incomplete"):
            usage = (obj.get("response") or {}).get("usage") or {}
            self.rec.prompt_tokens, self.rec.completion_tokens = usage.get("input_tokens"), usage.get("output_tokens")
            self.rec.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            self.rec.finish_reason = "length" if kind == "response.incomplete" else "stop"
            if self.rec.ttft is None:
                self.rec.ttft = t
            self.done = True
        elif kind in ("error", "response.failed"):
            self.rec.status = 500
            self._fail(f"error event: {obj.get('code') or kind}")
            self.done = kind == "response.failed"

    def finish(self, now: float) -> RequestRecord:
        """The stream ended (connection closed after the last chunk): fill e2e, judge completeness."""
        self.rec.e2e = now - self.sent_at
        if self.rec.error is None and not self.done:
            cut = "mid-event" if self.parser.pending else "before [DONE]"
            self.rec.error = f"broken stream: closed {cut}"  # finish_reason stays as seen (or abort)
        elif self.rec.error is None and self.rec.finish_reason not in ("stop", "length"):
            self.rec.error = "broken stream: [DONE] without a finish_reason"
        return self.rec


class EmbeddingReader:
    """Reads one /v1/embeddings response (JSON, not a stream) into a RequestRecord: its usage, no output."""

    def __init__(self, record: RequestRecord, sent_at: float) -> None:
        self.rec, self.sent_at, self.buf = record, sent_at, b""

    def feed(self, chunk: bytes, now: float) -> None:
        self.buf += chunk

    def finish(self, now: float) -> RequestRecord:
        rec = self.rec
        rec.e2e = now - self.sent_at
        if rec.error is not None:
            return rec
        try:
            obj = json.loads(self.buf)
            rec.prompt_tokens, rec.completion_tokens = obj["usage"]["prompt_tokens"], 0
            rec.inputs = len(obj["data"])
            rec.finish_reason = "stop"
        except (ValueError, KeyError, TypeError):
            rec.error = "broken response: not an embeddings list"
        return rec
