"""The batched sampler.

Order per row: logit_bias (added to the logits) → penalties (repetition over
prompt+output, frequency and presence over output, as in vLLM/HF) → min_tokens (EOS and
the request's stop token ids masked to -inf while it has fewer than min_tokens outputs) →
the grammar mask of a structured output (between `adjust` and `pick`, by the engine's
`serving.engine.grammar`) → temperature → top-k → top-p → min-p → draw.  Temperature 0 (or
top_k 1) is greedy.  The
first three (`adjust`) copy the logits only when some row needs them, so the engine keeps the
model's logits for `--logprobs-mode raw` (`serving.engine.logprobs`).  Each request draws
from its own `torch.Generator`, seeded by its `seed`, so a seeded request gives the same
tokens whoever shares its batch.

`protocol.sampling_params.SamplingParams.validate` bounds every field, so no value can
make this sampler raise for its batch mates; top_k is clamped to the vocabulary here.

The draw walks the distribution in descending order (the kept prefix after the cuts, then a
uniform from the request's generator against its cumulative sum).  Sorting the whole
vocabulary for that costs ~4 ms a row (49k tokens), so the most likely tokens are taken first
(`topk` of `PREFIXES`, growing), with the softmax's normaliser summed over the whole row: when
the cuts end inside that prefix, or the row has no cut and its uniform lands in it, the pick is
the one the full sort gives (the same order; probabilities and their cumulative sums in float64,
so an uncut row's total is 1 to ~1e-13 either way, where float32's sum over 49k tokens is off by
~1e-5, more than a tail token's whole probability); other rows try the next prefix, and the few
left sort the whole row.
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


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """In place on one row of logits [V]: each biased id's logit plus its bias."""
    ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
    logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype))


def below_min_tokens(row: SamplingRow) -> bool:
    """Fewer outputs than min_tokens: the token sampled now cannot end the request."""
    return len(row.output_ids) < row.params.min_tokens


def mask_stops(logits: torch.Tensor, row: SamplingRow, eos: frozenset[int]) -> None:
    """In place on one row of logits [V]: the ids that would end the request (EOS unless ignored, its stop
    token ids) can no longer be drawn."""
    ids = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else set(eos))
    ids = sorted(i for i in ids if i < logits.shape[0])
    if ids:
        logits[torch.tensor(ids, dtype=torch.int64)] = float("-inf")


def adjust(logits: torch.Tensor, rows: Sequence[SamplingRow], eos: frozenset[int] = frozenset()) -> torch.Tensor:
    """logit_bias, penalties and the min_tokens mask of every row that has them, on a copy of `logits`
    (`logits` itself when no row has any)."""
    touched = [i for i, r in enumerate(rows) if r.params.logit_bias or r.params.has_penalties or below_min_tokens(r)]
    if not touched:
        return logits
    logits = logits.clone()
    for i in touched:
        row = rows[i]
        if row.params.logit_bias:
            apply_logit_bias(logits[i], row.params)
        if row.params.has_penalties:
            apply_penalties(logits[i], row)
        if below_min_tokens(row):
            mask_stops(logits[i], row, eos)
    return logits


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


# Prefix sizes tried before a full sort.  SmolLM2 at temperature 1 and no cut, over 1500 positions of
# this repository's docs: the draw lands past the top 512 tokens 7.8 % of the time, past 4096 1.1 %.
PREFIXES = (512, 4096)


def _cuts(probs: torch.Tensor, rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
    """[R, N] bool: which of each row's N most likely tokens (`probs` descending, normalised over the
    whole vocabulary) top-k, top-p and min-p drop; the most likely token always survives."""
    ranks = torch.arange(probs.shape[-1])[None, :]
    top_k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows])[:, None]
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=probs.dtype)[:, None]
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype)[:, None]
    drop = ranks >= top_k
    drop |= (probs.cumsum(-1) - probs) > top_p  # keep the smallest prefix reaching top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    return drop


def _pick(ids: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token per row: the first of `ids` (descending) whose cumulative probability `cdf` reaches `target`."""
    return ids.gather(1, torch.searchsorted(cdf, target[:, None]).clamp_(max=cdf.shape[-1] - 1)).squeeze(1)


def _draw(sorted_ids: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row: the first of the (descending, cut) `probs` whose cumulative sum reaches u × the total."""
    cdf = probs.cumsum(-1)
    return _pick(sorted_ids, cdf, u * cdf[:, -1])


def _sorted_cut(scaled: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary sorted: token ids and their cut probabilities, per row."""
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.double(), dim=-1)
    return sorted_ids, probs.masked_fill(_cuts(probs, rows, probs.shape[-1]), 0.0)


def _uniforms(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One uniform per row from the request's own generator: batch mates cannot shift each other's streams."""
    return torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in rows])


def _uncut_tail(p: SamplingParams, vocab: int) -> bool:
    """No cut can drop a token for its rank, mass or share: past any prefix, everything is kept."""
    return (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0


def _normaliser(scaled: torch.Tensor, peak: torch.Tensor, masked: Sequence[bool] | None) -> torch.Tensor:
    """[R, 1]: each row's sum of exp(logit - peak) over the whole vocabulary, in float64.

    A masked row's -inf logits (a grammar's mask) send exp down its slow path (~2x the op over 16 rows of
    49k); raised to EXP_FLOOR first, they add at most 49k × 1e-304 to a sum of at least 1 (its peak's own
    term): the same sum to the last bit, at the speed of an unmasked row.  Only masked rows are raised."""
    z = scaled.double() - peak
    at = [i for i, m in enumerate(masked) if m] if masked is not None else []
    if len(at) == len(z):
        z.clamp_(min=EXP_FLOOR)
    elif at:
        idx = torch.tensor(at, dtype=torch.int64)
        z[idx] = z[idx].clamp_(min=EXP_FLOOR)
    return torch.exp(z).sum(-1, keepdim=True)


EXP_FLOOR = -700.0  # exp(-700) ≈ 1e-304: a normal float64, so exp takes its fast path


def _from_prefix(
    scaled: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor, k: int, masked: Sequence[bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, found) per row from its `k` most likely tokens: found where the draw is the full sort's."""
    vocab = scaled.shape[-1]
    top, top_ids = torch.topk(scaled, k, dim=-1)
    top = top.double()
    peak = top[:, :1]
    probs = torch.exp(top - peak) / _normaliser(scaled, peak, masked)
    drop = _cuts(probs, rows, vocab)
    cdf = probs.masked_fill(drop, 0.0).cumsum(-1)
    # A dropped set only grows with rank: the prefix's last token dropped means nothing past it is kept.
    inside = drop[:, -1]
    open_tail = torch.tensor([_uncut_tail(r.params, vocab) for r in rows])
    target = u * torch.where(inside, cdf[:, -1], torch.ones_like(u))  # an uncut row's total is all of it
    found = inside | (open_tail & (target <= cdf[:, -1]))
    return _pick(top_ids, cdf, target), found


def _random(logits: torch.Tensor, rows: Sequence[SamplingRow], masked: Sequence[bool] | None = None) -> torch.Tensor:
    """One token per row of logits [R, V] for rows that sample (see the module's docstring); `masked`: which
    rows carry a grammar's mask (-inf logits)."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)[:, None]
    scaled = logits / temps
    u = _uniforms(rows)  # nothing below raises: the draws come last
    out = torch.empty(len(rows), dtype=torch.int64)
    left = torch.arange(len(rows))  # rows whose pick is not known yet
    for k in PREFIXES:
        if k >= scaled.shape[-1]:
            break
        whole = len(left) == len(rows)  # no copy of the logits while every row is left
        part = scaled if whole else scaled[left]
        sub = left.tolist()
        picks, found = _from_prefix(
            part,
            rows if whole else [rows[i] for i in sub],
            u[left],
            k,
            masked if whole or masked is None else [masked[i] for i in sub],
        )
        out[left[found]] = picks[found]
        left = left[~found]
        if len(left) == 0:
            return out
    sorted_ids, kept = _sorted_cut(scaled[left], [rows[i] for i in left.tolist()])
    out[left] = _draw(sorted_ids, kept, u[left])
    return out


def probabilities(adjusted: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """float64 [R, V]: the distribution each row of `adjust`ed logits is drawn from (temperature, then the
    top-k / top-p / min-p cuts, renormalised) -- what the draw in `pick` samples, as numbers (speculative
    decoding's acceptance test, `serving.engine.spec_accept`).  Rows must not be greedy."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=adjusted.dtype)[:, None]
    if all(_uncut_tail(r.params, adjusted.shape[-1]) for r in rows):  # no cut: no sort
        return torch.softmax((adjusted / temps).double(), dim=-1)
    sorted_ids, kept = _sorted_cut(adjusted / temps, rows)
    probs = torch.zeros_like(kept).scatter_(1, sorted_ids, kept)
    return probs / probs.sum(-1, keepdim=True)


def pick(adjusted: torch.Tensor, rows: Sequence[SamplingRow], masked: Sequence[bool] | None = None) -> torch.Tensor:
    """One token per row of `adjust`ed logits [R, V]: the argmax of greedy rows, a draw for the others;
    `masked`: per row, whether a grammar's mask was added to it (None: no row)."""
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows and len(random_rows) == len(rows):
        return _random(adjusted, rows, masked)
    out = adjusted.argmax(dim=-1)
    if random_rows:
        idx = torch.tensor(random_rows, dtype=torch.int64)
        out[idx] = _random(
            adjusted[idx], [rows[i] for i in random_rows], None if masked is None else [masked[i] for i in random_rows]
        )
    return out


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], eos: frozenset[int] = frozenset()) -> list[int]:
    """Pick one token per row of logits [R, V]; `rows[i]` is the request of row i, `eos` the model's EOS ids
    (masked while a row is below its min_tokens).

    The random draws come last: if anything before them raises, no request's generator
    has moved, so the engine can retry the rows (without the culprit) and seeded requests
    still reproduce.
    """
    if logits.shape[0] != len(rows):
        raise ValueError("one sampling row per logits row")
    return pick(adjust(logits, rows, eos), rows).tolist()
