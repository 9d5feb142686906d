"""The Responses API's shapes, built from what the chat route produces for the same request: the response
object from a chat completion body, and the typed event stream from its chunks.

A stream is `response.created`, `response.in_progress`, then per output item `response.output_item.added`
… `.done` (a message: `response.content_part.added`, `response.output_text.delta`…, `.output_text.done`,
`.content_part.done`; a function call: `response.function_call_arguments.delta`…, `.done`; reasoning, with
a reasoning parser: `response.reasoning_text.delta`…, `.done`), and `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it; `error` + `response.failed` when the engine failed
it), each numbered by `sequence_number`.  Items follow one another: the next opens once the last is done.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from serving.frontend.http.routes.openai_shapes import openai_finish


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict | None) -> dict:
    """Chat's usage object in Responses' names (`cache_write_tokens`: OpenAI's explicit cache writes; the
    prefix cache here keeps prompts without being asked, so none)."""
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": u.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": u.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": u.get("total_tokens", 0),
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [output_text(text)] if text is not None else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    fn = call.get("function") or {}
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.get("id") or new_id("call"),
        "name": fn.get("name") or "",
        "arguments": fn.get("arguments") or "",
        "status": status,
    }


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict) -> list[dict]:
    """A chat choice's message as output items: reasoning, the text, then each call."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(new_id("msg"), message.get("content") or ""))
    items += [call_item(new_id("fc"), call) for call in message.get("tool_calls") or ()]
    return items


class ResponseObject:
    """One response's envelope: its id, creation time, model and the request's settings echoed."""

    def __init__(self, rid: str, model: str, echo: dict) -> None:
        self.id, self.model, self.echo = f"resp_{rid}", model, echo
        self.created_at = int(time.time())

    def body(
        self,
        status: str,
        output: list[dict],
        use: dict | None = None,
        finish: str | None = None,
        error: dict | None = None,
    ) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "model": self.model,
            "output": output,
            "usage": use,
            **self.echo,
        }

    def from_chat(self, chat: dict) -> dict:
        """The response of a whole (non-streamed) chat completion body."""
        choice = chat["choices"][0]
        finish = openai_finish(choice["finish_reason"])
        out = self.body(
            "incomplete" if finish == "length" else "completed",
            output_items(choice["message"]),
            usage(chat.get("usage")),
            finish,
        )
        out["sightline"] = chat.get("sightline")
        return out


class EventStream:
    """Chat chunks (`openai_responses.chunks`) → Responses' typed events."""

    def __init__(self, obj: ResponseObject) -> None:
        self.obj = obj
        self.seq = 0
        self.items: list[dict] = []  # the output so far, the last one possibly still open
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # chat's tool-call index → its item
        self.finish: str | None = None
        self.use: dict | None = None
        self.breakdown: dict | None = None
        self.final: dict | None = None  # the response object once it ended

    def _ev(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        body = self.obj.body("in_progress", [])
        return [self._ev("response.created", response=body), self._ev("response.in_progress", response=body)]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _add(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        events.append(self._ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if item["type"] == "message":
            item["content"] = [output_text("")]
            events.append(
                self._ev("response.content_part.added", content_index=0, part=output_text(""), **self._where(item))
            )
        return events

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = self._where(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                self._ev("response.output_text.done", content_index=0, text=part["text"], logprobs=[], **at),
                self._ev("response.content_part.done", content_index=0, part=dict(part), **at),
            ]
        elif item["type"] == "function_call":
            events.append(
                self._ev("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"], **at)
            )
        else:
            events.append(
                self._ev("response.reasoning_text.done", content_index=0, text=item["content"][0]["text"], **at)
            )
        item["status"] = "completed"
        events.append(self._ev("response.output_item.done", output_index=at["output_index"], item=item))
        return events

    def chunk(self, chunk: dict) -> list[dict]:
        """One chat chunk's events (none for the role chunk)."""
        if "error" in chunk:
            return self._failed(chunk["error"] or {})
        if not chunk.get("choices") and chunk.get("usage"):
            self.use, self.breakdown = chunk["usage"], chunk.get("sightline")
        events: list[dict] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish = openai_finish(choice["finish_reason"])
        return events

    def _reasoning(self, text: str) -> list[dict]:
        events = (
            []
            if self.open is not None and self.open["type"] == "reasoning"
            else self._add({**reasoning_item(new_id("rs"), ""), "status": "in_progress"})
        )
        self.open["content"][0]["text"] += text
        return events + [
            self._ev("response.reasoning_text.delta", content_index=0, delta=text, **self._where(self.open))
        ]

    def _text(self, text: str) -> list[dict]:
        events = (
            []
            if self.open is not None and self.open["type"] == "message"
            else self._add(message_item(new_id("msg"), None, "in_progress"))
        )
        self.open["content"][0]["text"] += text
        return events + [
            self._ev("response.output_text.delta", content_index=0, delta=text, logprobs=[], **self._where(self.open))
        ]

    def _call(self, delta: dict) -> list[dict]:
        events = []
        item = self.calls.get(delta["index"])
        if item is None:
            item = call_item(
                new_id("fc"), {**delta, "function": {**delta.get("function", {}), "arguments": ""}}, "in_progress"
            )
            self.calls[delta["index"]] = item
            events += self._add(item)
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self._ev("response.function_call_arguments.delta", delta=piece, **self._where(item)))
        return events

    def end(self) -> list[dict]:
        """The stream's last events: the open item closed, then the response whole."""
        events = self._close()
        if not self.items:  # nothing was generated: still one (empty) message, as a whole response has
            events += self._add(message_item(new_id("msg"), None, "in_progress")) + self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        self.final = self.obj.body(status, self.items, usage(self.use), self.finish)
        self.final["sightline"] = self.breakdown
        return events + [self._ev(f"response.{status}", response=self.final)]

    def _failed(self, err: dict) -> list[dict]:
        """The engine failed the request mid-stream: OpenAI's error event, then the failed response."""
        message = err.get("message") or "the engine failed this request"
        body = self.obj.body("failed", self.items, usage(self.use), error={"code": "server_error", "message": message})
        return [
            self._ev("error", code=err.get("code") or err.get("type"), message=message, param=None),
            self._ev("response.failed", response=body),
        ]
