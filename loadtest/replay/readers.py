"""How a replayed request's response is read (streamed or not) into the load tester's
`RequestRecord`, keeping the server's own breakdown for the report, and the line each
send leaves in `replay_sent.jsonl`."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from loadtest.records import RequestRecord as ClientRecord
from loadtest.replay.schedule import SUCCESS, ReplayItem
from loadtest.sse import ANTHROPIC_FINISH, StreamReader, anthropic_usage


class ReplayStreamReader(StreamReader):
    """An OpenAI stream; also keeps the server's `sightline` breakdown (usage chunk) and the
    response's `x-request-id`."""

    def __init__(self, record: ClientRecord, sent_at: float) -> None:
        super().__init__(record, sent_at)
        self.server: dict | None = None
        self.request_id: str | None = None

    def on_response(self, resp: Any) -> None:
        self.request_id = resp.headers.get("x-request-id")

    def _event(self, data: str, t: float) -> None:
        if data != "[DONE]":
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                found = (
                    obj.get("sightline")
                    or (obj.get("meta_info") or {}).get("sightline")
                    or (obj.get("response") or {}).get("sightline")
                )
                if found:
                    self.server = found
                if "meta_info" in obj and "error" not in obj:
                    self._generate_event(obj, t)
                    return
        super()._event(data, t)

    def _generate_event(self, obj: dict, t: float) -> None:
        """SGLang's /generate stream: each event has the whole text so far and meta_info."""
        text, meta = obj.get("text") or "", obj["meta_info"]
        if len(text) > getattr(self, "_text_len", 0):
            self._text_len = len(text)
            self.rec.chunk_times.append(t)
            if self.rec.ttft is None:
                self.rec.ttft = t
        self.rec.prompt_tokens = meta.get("prompt_tokens")
        self.rec.completion_tokens = meta.get("completion_tokens")
        self.rec.cached_tokens = meta.get("cached_tokens")
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish:
            self.rec.finish_reason = finish
            if self.rec.ttft is None:
                self.rec.ttft = t


class ReplayBodyReader:
    """A non-streaming response: the JSON body, read whole (no client TTFT: the server's breakdown
    in the body has it)."""

    def __init__(self, record: ClientRecord, sent_at: float) -> None:
        self.rec, self.sent_at = record, sent_at
        self.buf = b""
        self.server: dict | None = None
        self.request_id: str | None = None

    def on_response(self, resp: Any) -> None:
        self.request_id = resp.headers.get("x-request-id")

    def feed(self, chunk: bytes, now: float) -> None:
        self.buf += chunk

    def finish(self, now: float) -> ClientRecord:
        rec = self.rec
        rec.e2e = now - self.sent_at
        if rec.error is not None:
            return rec
        try:
            obj = json.loads(self.buf)
        except ValueError:
            rec.error = "broken response: invalid JSON"
            return rec
        if obj.get("object") == "list" or "results" in obj:  # embeddings, score, rerank: usage, nothing generated
            self.server = obj.get("sightline")
            rec.prompt_tokens, rec.completion_tokens, rec.finish_reason = (
                (obj.get("usage") or {}).get("prompt_tokens"),
                0,
                "stop",
            )
            return rec
        if obj.get("type") == "message":  # /v1/messages
            anthropic_usage(rec, obj.get("usage") or {})
            self.server = obj.get("sightline")
            rec.finish_reason = ANTHROPIC_FINISH.get(obj.get("stop_reason"), "abort")
            if rec.finish_reason not in SUCCESS:
                rec.error = f"no stop_reason in the response ({obj.get('stop_reason')})"
            return rec
        if obj.get("object") == "response":  # /v1/responses
            use = obj.get("usage") or {}
            usage = {"prompt_tokens": use.get("input_tokens"), "completion_tokens": use.get("output_tokens")}
            cached = (use.get("input_tokens_details") or {}).get("cached_tokens")
            finish = {"completed": "stop", "incomplete": "length"}.get(obj.get("status"))
            self.server = obj.get("sightline")
        elif "meta_info" in obj:  # /generate
            meta = obj["meta_info"]
            usage = {"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens")}
            cached = meta.get("cached_tokens")
            finish = (meta.get("finish_reason") or {}).get("type")
            self.server = meta.get("sightline")
        else:
            usage = obj.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            finish = ((obj.get("choices") or [{}])[0]).get("finish_reason")
            self.server = obj.get("sightline")
        rec.prompt_tokens, rec.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        rec.cached_tokens = cached
        rec.finish_reason = finish or "abort"
        if finish not in SUCCESS:
            rec.error = f"no finish_reason in the response ({finish})"
        return rec


def reader_class(item: ReplayItem) -> type:
    return ReplayStreamReader if item.stream else ReplayBodyReader


def sent_line(item: ReplayItem, sent_s: float, reader: Any) -> str:
    """One line of replay_sent.jsonl: the schedule's item, when it was really sent, what came back."""
    return json.dumps(
        {
            "index": item.index,
            "rid": item.rid,
            "due_s": item.due,
            "sent_s": round(sent_s, 6),
            "request_id": reader.request_id,
            "server": reader.server,
            "record": asdict(reader.rec),
        },
        separators=(",", ":"),
    )
