"""OpenAI response bodies and SSE chunks for completions and chat: plain dicts shaped exactly like
OpenAI's (see docs/api.md).  One response may hold several choices (`n`, or a list of prompts on
completions): each chunk names its choice's `index`."""

from __future__ import annotations

import time

from protocol.io_struct import Logprobs
from serving.frontend.http.routes.logprob_shapes import (
    CompletionLogprobs,
    TokenText,
    chat_content,
    vllm_prompt_logprobs,
)
from serving.frontend.output_parsing import ParsedAnswer


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache served;
    `completion_tokens_details.reasoning_tokens` with a reasoning parser (--reasoning-parser)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def openai_finish(reason: str | None) -> str | None:
    """OpenAI's stop, length and tool_calls; an abort that still produced a response reads as stop."""
    return None if reason is None else reason if reason in ("length", "tool_calls") else "stop"


class ChoiceLogprobs:
    """The logprobs of one choice as its chunks go out: chat's content entries, or completions' object
    (whose `text_offset` runs on over the chunks, from after the echoed prompt)."""

    def __init__(self, chat: bool, tt: TokenText | None) -> None:
        self.chat = chat
        self.tt = tt
        self.completion = CompletionLogprobs(tt) if tt is not None and not chat else None

    def echo(self, prompt_ids: list[int], lp: Logprobs | None) -> dict | None:
        """Completions with echo: the prompt's part (its first token's logprob null)."""
        return self.completion.part(prompt_ids, lp, first_is_null=True) if self.completion else None

    def skip(self, chars: int) -> None:
        """Text the client sees before the logged tokens (an echoed prompt without logprobs)."""
        if self.completion is not None:
            self.completion.offset += chars

    def part(self, ids: list[int], lp: Logprobs | None) -> dict | None:
        if lp is None or self.tt is None:
            return None
        if self.chat:
            return {"content": chat_content(lp, ids, self.tt)}
        return self.completion.part(ids, lp)


class ResponseShape:
    """Builds the bodies and SSE chunks of one request, for completions or chat."""

    def __init__(
        self,
        chat: bool,
        rid: str,
        model: str,
        with_usage: bool,
        continuous: bool = False,
        tokens: TokenText | None = None,
    ) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self.with_usage = with_usage
        self.continuous = continuous  # every chunk carries the usage so far, not null
        self.tokens = tokens  # token id → text and bytes, for logprobs

    def logprobs(self) -> ChoiceLogprobs:
        return ChoiceLogprobs(self.chat, self.tokens)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def choice(
        self,
        index: int,
        text: str,
        finish: str | None,
        logprobs: dict | None = None,
        prompt_logprobs: list | None = None,
    ) -> dict:
        """One choice of a whole (non-streamed) response."""
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": openai_finish(finish),
            }
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": openai_finish(finish)}
        if prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs
        return out

    def message(
        self, index: int, answer: ParsedAnswer, finish: str | None, logprobs: dict | None, reasoning: bool
    ) -> dict:
        """One chat choice whose answer was read for reasoning and tool calls (serving.frontend.output_parsing):
        `reasoning_content` with a reasoning parser, `tool_calls` when it called (then content may be null)."""
        msg: dict = {"role": "assistant", "content": answer.content}
        if reasoning:
            msg["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            msg["tool_calls"] = answer.tool_calls
        return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": openai_finish(finish)}

    def body(self, choices: list[dict], use: dict, prompt_logprobs: list | None = None) -> dict:
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and prompt_logprobs is not None:  # vLLM puts chat's on the response
            body["prompt_logprobs"] = prompt_logprobs
        body["usage"] = use
        return body

    def full(
        self, text: str, finish: str | None, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict:
        """A one-choice response without logprobs."""
        return self.body([self.choice(0, text, finish)], usage(prompt_tokens, completion_tokens, cached_tokens))

    def prompt_logprobs(self, prompt_ids: list[int], lp: Logprobs | None) -> list | None:
        """vLLM's `prompt_logprobs` field, when asked for and computed."""
        return vllm_prompt_logprobs(prompt_ids, lp, self.tokens) if lp is not None and self.tokens else None

    def running_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict | None:
        """The usage so far for a chunk: a usage object with `continuous_usage_stats`, else None."""
        return usage(prompt_tokens, completion_tokens, cached_tokens) if self.continuous else None

    def _chunk(self, choices: list, running: dict | None) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)
        if self.with_usage:
            body["usage"] = running
        return body

    def role_chunk(self, running: dict | None = None, index: int = 0) -> dict:
        return self._chunk(
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            running,
        )

    def delta_chunk(
        self,
        text: str,
        finish: str | None,
        running: dict | None = None,
        index: int = 0,
        logprobs: dict | None = None,
        delta: dict | None = None,
    ) -> dict:
        """`delta`: a parsed chat answer's fields (reasoning_content, content, tool_calls) instead of `text`."""
        if self.chat:
            delta = delta if delta is not None else {"content": text} if text else {}
            return self._chunk(
                [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": openai_finish(finish)}],
                running,
            )
        return self._chunk(
            [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": openai_finish(finish)}], running
        )

    def usage_chunk(self, use: dict) -> dict:
        """The last chunk of a stream with `include_usage`: no choices, the whole request's usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = use
        return body
