"""OpenAI response bodies and SSE chunks for completions and chat: plain dicts shaped exactly like
OpenAI's (see docs/api.md)."""

from __future__ import annotations

import time


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_finish(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an abort that still produced a response reads as stop."""
    return None if reason is None else ("length" if reason == "length" else "stop")


class ResponseShape:
    """Builds the bodies and SSE chunks of one request, for completions or chat."""

    def __init__(self, chat: bool, rid: str, model: str, with_usage: bool, continuous: bool = False) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self.with_usage = with_usage
        self.continuous = continuous  # every chunk carries the usage so far, not null

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": openai_finish(finish)}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                                       "finish_reason": openai_finish(finish)}])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def full_result(self, result) -> dict:
        """`full` for a TokenizerManager `Collected` result."""
        return self.full(result.text, result.finish_reason, result.prompt_tokens, result.completion_tokens,
                         result.cached_tokens)

    def running_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict | None:
        """The usage so far for a chunk: a usage object with `continuous_usage_stats`, else None."""
        return usage(prompt_tokens, completion_tokens, cached_tokens) if self.continuous else None

    def _chunk(self, choices: list, running: dict | None) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)
        if self.with_usage:
            body["usage"] = running
        return body

    def role_chunk(self, running: dict | None = None) -> dict:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], running)

    def delta_chunk(self, text: str, finish: str | None, running: dict | None = None) -> dict:
        if self.chat:
            delta = {"content": text} if text else {}
            return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": openai_finish(finish)}],
                               running)
        return self._chunk([{"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish(finish)}],
                           running)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body
