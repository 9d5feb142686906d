"""Engine logprobs (`protocol.io_struct.Logprobs`: token ids and floats) in the shapes OpenAI and vLLM
clients read: chat's `logprobs.content[]`, completions' `tokens`/`token_logprobs`/`top_logprobs`/
`text_offset` (with `echo`, the prompt's come first, its first token's logprob null), and vLLM's
`prompt_logprobs` (per position a dict keyed by token id, the prompt token itself included).

A token's text is what decoding it alone gives; its `bytes` are its exact bytes where the tokenizer
is byte-level BPE (a token that ends inside a UTF-8 character shows as U+FFFD in its text, but its
bytes are the real ones, so a client can join them), else the UTF-8 of its text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from protocol.io_struct import Logprobs


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is spelled with → the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenText:
    """Token id → (text, bytes), cached: a response names the same few thousand tokens over and over."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(tid)
            table = _byte_decoder()
            if isinstance(piece, str) and piece and all(c in table for c in piece):
                raw = [table[c] for c in piece]
            else:
                raw = list(text.encode("utf-8"))
            hit = self._cache[tid] = (text, raw)
            if len(self._cache) > 65536:
                self._cache.clear()
        return hit

    def text(self, tid: int) -> str:
        return self(tid)[0]


def chat_content(lp: Logprobs, ids: list[int], tt: TokenText) -> list[dict]:
    """`choices[].logprobs.content` of chat completions: one entry per output token."""
    out = []
    for i, tid in enumerate(ids):
        text, raw = tt(tid)
        tops = []
        if lp.top_ids:
            for alt, alp in zip(lp.top_ids[i], lp.top_logprobs[i]):
                atext, araw = tt(alt)
                tops.append({"token": atext, "logprob": alp, "bytes": araw})
        out.append({"token": text, "logprob": lp.token_logprobs[i], "bytes": raw, "top_logprobs": tops})
    return out


class CompletionLogprobs:
    """Completions' `logprobs` object, built up over a response (streamed chunks each carry their part)."""

    def __init__(self, tt: TokenText, offset: int = 0) -> None:
        self.tt = tt
        self.offset = offset  # characters of text before the next token (text_offset)

    def part(self, ids: list[int], lp: Logprobs | None, first_is_null: bool = False) -> dict:
        """The object for `ids`; `first_is_null` for an echoed prompt (its first token has no logprob).
        `lp` covers ids[1:] when `first_is_null`, else all of `ids`."""
        tokens, offsets, values, tops = [], [], [], []
        for i, tid in enumerate(ids):
            text = self.tt.text(tid)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            j = i - 1 if first_is_null else i
            if j < 0 or lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(lp.token_logprobs[j])
            top = {self.tt.text(a): v for a, v in zip(lp.top_ids[j], lp.top_logprobs[j])} if lp.top_ids else {}
            top.setdefault(text, lp.token_logprobs[j])  # the token itself is always listed, as vLLM does
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def merge_parts(a: dict | None, b: dict | None) -> dict | None:
    """Two consecutive completions logprobs objects as one."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def vllm_prompt_logprobs(prompt_ids: list[int], lp: Logprobs, tt: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per position a dict keyed by token id
    (the prompt token first, then its top alternatives) of {logprob, rank, decoded_token}; `rank` is the
    1-based place in the top list, null for a prompt token outside it."""
    out: list[dict | None] = [None]
    for j, tid in enumerate(prompt_ids[1:]):
        entry: dict[str, dict] = {}
        ids = lp.top_ids[j] if lp.top_ids else []
        vals = lp.top_logprobs[j] if lp.top_ids else []
        rank = ids.index(tid) + 1 if tid in ids else None
        entry[str(tid)] = {"logprob": lp.token_logprobs[j], "rank": rank, "decoded_token": tt.text(tid)}
        for r, (alt, v) in enumerate(zip(ids, vals), start=1):
            entry.setdefault(str(alt), {"logprob": v, "rank": r, "decoded_token": tt.text(alt)})
        out.append(entry)
    return out
