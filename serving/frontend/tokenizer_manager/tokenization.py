"""Prompt → token ids for the TokenizerManager, without freezing its event loop.

Two defences, in order:
1. **Cheap size checks before tokenizing** (`check_size`): characters of the prompt or of
   all messages against `max_chars` (default 16 per token of the context window: no
   realistic text averages more, so a longer input could never fit), the number of chat
   messages, and the length of a token-id prompt against the context.  A 4 MB prompt is
   refused in microseconds instead of after seconds of tokenizing.
2. **What is allowed but large runs in a worker thread** (`encode`).  Measured on the
   bundled tokenizer: a 210k-character encode takes ~0.2 s, but the fast (Rust)
   tokenizer releases the GIL while it encodes, so the loop keeps serving other streams
   (≤ 12 ms gaps); chat-template rendering is Python bytecode, which yields the GIL every
   switch interval (5 ms).  Small inputs (< `INLINE_CHARS`) are tokenized inline: a thread
   hop would cost more than the work.  One worker keeps arrival order.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from protocol.io_struct import Ready
from serving.frontend.errors import APIError, bad_request
from serving.frontend.output_parsing import ParsingConfig
from serving.frontend.tokenizer_manager import generation_defaults
from serving.frontend.tokenizer_manager.chat_template import ChatTemplateOptions, load_template, render
from serving.frontend.tokenizer_manager.grammar_check import GrammarChecker

log = logging.getLogger(__name__)

INLINE_CHARS = 2048
CHARS_PER_TOKEN = 16
MIN_TOKENS_PER_MESSAGE = 4  # a chat template spends at least this many tokens on each message


@dataclass(frozen=True)
class InputLimits:
    max_chars: int
    max_messages: int

    @classmethod
    def for_context(cls, context_len: int, max_chars: int | None, max_messages: int | None) -> "InputLimits":
        return cls(
            max_chars or CHARS_PER_TOKEN * context_len, max_messages or max(16, context_len // MIN_TOKENS_PER_MESSAGE)
        )


def prompt_too_long(context_len: int, tokens: int, param: str) -> APIError:
    return bad_request(
        f"This model's maximum context length is {context_len} tokens, but the prompt has {tokens} "
        "tokens (at least one token must be generated).",
        param=param,
        code="context_length_exceeded",
    )


def input_chars(obj: Any) -> int:
    """Characters the tokenizer would see (prompt string, or every message's content)."""
    if obj.messages is not None:
        tools = getattr(getattr(obj, "template", None), "tools", None)  # rendered into the prompt too
        return sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) for m in obj.messages) + len(
            str(tools or "")
        )
    return len(obj.prompt) if isinstance(obj.prompt, str) else 0


def check_size(obj: Any, context_len: int, limits: InputLimits) -> None:
    """Raise a 400 for an input that is too large to be worth tokenizing."""
    if obj.messages is not None and len(obj.messages) > limits.max_messages:
        raise bad_request(
            f"at most {limits.max_messages} messages are allowed, got {len(obj.messages)}",
            param="messages",
            code="too_many_messages",
        )
    if isinstance(obj.prompt, list) and len(obj.prompt) >= context_len:
        raise prompt_too_long(context_len, len(obj.prompt), "prompt")
    chars = input_chars(obj)
    if chars > limits.max_chars:
        param = "messages" if obj.messages is not None else "prompt"
        raise bad_request(
            f"the {param} has {chars} characters; the limit is {limits.max_chars} "
            f"(see --max-prompt-chars); it could not fit the {context_len}-token context",
            param=param,
            code="context_length_exceeded",
        )


def check_tokens(obj: Any, ids: list[int], ready: Ready) -> None:
    """The tokenized prompt against the context window (`Ready`), and the sampling parameters against the
    vocabulary; sets `max_new_tokens` to what the window leaves when the request named none."""
    names = obj.param_names
    if not ids:
        raise bad_request(
            "prompt is empty", param="messages" if obj.messages is not None else "prompt", code="empty_prompt"
        )
    ctx = ready.context_len
    if len(ids) >= ctx:
        raise prompt_too_long(ctx, len(ids), "messages" if obj.messages is not None else "prompt")
    want = obj.max_new_tokens
    # 0 (completions with echo: the prompt's logprobs alone): the engine runs one token, the route drops it
    obj.sampling.max_new_tokens = ctx - len(ids) if want is None else max(want, 1)
    if want is not None and len(ids) + want > ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{len(ids) + want} tokens ({len(ids)} in the prompt, {want} for the completion).",
            param=names.get("max_new_tokens", "max_new_tokens"),
            code="context_length_exceeded",
        )
    try:
        obj.sampling.validate(ready.vocab_size)
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0]
        param = names.get(field_name, field_name)
        raise bad_request(str(exc).replace(field_name, param, 1), param=param) from None


class PromptTokenizer:
    """Renders chat messages and encodes prompts; large inputs off the event loop.

    It also holds what the model directory and the flags say about turning a request into
    tokens: `--chat-template` (instead of the tokenizer's) and the sampling defaults of
    generation_config.json (`--generation-config auto`), both read once at start; the output
    parsers the flags and the template pick (`parsing`); and the checker of structured-output
    constraints (`grammar`).
    """

    def __init__(self, tokenizer: Any, args: Any = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = load_template(getattr(args, "chat_template", None))
        if self.chat_template is not None:
            log.info(
                "chat template from --chat-template (%d characters) instead of the tokenizer's", len(self.chat_template)
            )
        mode = getattr(args, "generation_config", "none")
        self.defaults = generation_defaults.load(getattr(tokenizer, "name_or_path", None), mode)
        self.parsing = ParsingConfig.load(args, tokenizer, self.chat_template)
        self.grammar = GrammarChecker(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sightline-tokenize")

    def render(self, messages: list[dict[str, Any]], template: ChatTemplateOptions | None) -> str:
        return render(self.tokenizer, messages, template, self.chat_template)

    def encode_sync(self, obj: Any, vocab_size: int) -> list[int]:
        if obj.messages is not None:
            text = self.render(obj.messages, getattr(obj, "template", None))
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(obj.prompt, str):
            return self.tokenizer(obj.prompt)["input_ids"]
        ids = list(obj.prompt or [])
        if any(not 0 <= t < vocab_size for t in ids):
            raise bad_request(f"token ids must be in [0, {vocab_size})", param="prompt", code="invalid_token_id")
        return ids

    async def encode(self, obj: Any, vocab_size: int) -> list[int]:
        if input_chars(obj) < INLINE_CHARS and (obj.messages is None or len(obj.messages) < 64):
            return self.encode_sync(obj, vocab_size)
        return await self.off_loop(self.encode_sync, obj, vocab_size)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the tokenize thread (in arrival order): the event loop keeps serving streams."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
