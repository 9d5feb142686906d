"""Sampling parameters and the batched sampler.

Order per row, as in vLLM/HF: penalties (repetition over prompt+output, frequency and
presence over output) → temperature → top-k → top-p → min-p → draw.  Temperature 0
(or top_k 1) is greedy.  Each request draws from its own `torch.Generator`, seeded by
its `seed`, so a seeded request gives the same tokens whoever shares its batch.

`SamplingParams.validate` bounds every field, so no value can make the batched sampler
raise for its batch mates: top_k is -1, 0 or in [1, MAX_TOP_K] (clamped to the vocabulary
here), floats are finite and in range, seed is in [0, 2**63), and at most
MAX_STOP_TOKEN_IDS stop token ids are valid ids.  A temperature under GREEDY_TEMPERATURE
is greedy (dividing logits by it would overflow float32 into NaN).
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import msgspec
import torch

MAX_TOP_K = 2**31 - 1
MAX_STOP_TOKEN_IDS = 64  # per request; the engine checks each sampled token against them
MAX_TOKEN_ID = 2**31 - 1  # bound on a token id when the vocabulary is not known
GREEDY_TEMPERATURE = 1e-5  # below it sampling is greedy


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError "<field> <why>, got <value>" for the first out-of-range field (the API's 400)."""
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in floats:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        checks = [
            (1 <= self.max_new_tokens <= 2**31 - 1, "max_new_tokens", "must be in [1, 2147483647]"),
            (0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K, "top_k",
             f"must be -1 or 0 (disabled) or in [1, {MAX_TOP_K}]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, got {len(ids)}")
        limit = vocab_size if vocab_size is not None else MAX_TOKEN_ID + 1
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be token ids in [0, {limit}), got {bad!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class SamplingRow(Protocol):
    """What the sampler needs from a request (serving.engine.request.Req satisfies it)."""

    params: SamplingParams
    generator: torch.Generator
    input_ids: list[int]
    output_ids: list[int]


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row of logits [V]."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.input_ids) | set(row.output_ids)), dtype=torch.int64)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, dtype=torch.int64), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted token ids and their truncated, unnormalised probabilities, per row."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)[:, None]
    sorted_logits, sorted_ids = torch.sort(logits / temps, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    top_k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows])[:, None]
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=probs.dtype)[:, None]
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype)[:, None]
    drop = ranks >= top_k
    drop |= (probs.cumsum(-1) - probs) > top_p  # keep the smallest prefix reaching top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return sorted_ids, probs.masked_fill(drop, 0.0)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Pick one token per row of logits [R, V]; `rows[i]` is the request of row i.

    The random draws come last: if anything before them raises, no request's generator
    has moved, so the engine can retry the rows (without the culprit) and seeded requests
    still reproduce.
    """
    if logits.shape[0] != len(rows):
        raise ValueError("one sampling row per logits row")
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if penalised:
        logits = logits.clone()
        for i in penalised:
            apply_penalties(logits[i], rows[i])
    out = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        idx = torch.tensor(random_rows, dtype=torch.int64)
        sub = [rows[i] for i in random_rows]
        sorted_ids, probs = _filtered_probs(logits[idx], sub)
        cdf = probs.cumsum(-1)
        # One uniform per row from the request's own generator: batch mates cannot
        # shift each other's random streams.
        u = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in sub]).to(cdf.dtype)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[-1] - 1)
        out[idx] = sorted_ids.gather(1, pick).squeeze(1)
    return out.tolist()
