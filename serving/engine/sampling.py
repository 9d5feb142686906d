"""The batched sampler.

Order per row, as in vLLM/HF: penalties (repetition over prompt+output, frequency and
presence over output) → temperature → top-k → top-p → min-p → draw.  Temperature 0
(or top_k 1) is greedy.  Each request draws from its own `torch.Generator`, seeded by
its `seed`, so a seeded request gives the same tokens whoever shares its batch.

`protocol.sampling_params.SamplingParams.validate` bounds every field, so no value can
make this sampler raise for its batch mates; top_k is clamped to the vocabulary here.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from protocol.sampling_params import SamplingParams


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
