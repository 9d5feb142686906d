"""One ragged forward batch: decode tokens and prefill (extend) chunks side by side.

Tokens are laid out flat: first one token per decoding request, then each extend
chunk contiguously.  Projections and MLP run once over all of them; attention runs
batched (padded) for the decode group and per chunk for extends, reading K/V from the
paged pool through each request's slot table.  With a sliding window, a token attends to
the last `window` positions only (itself included, as in transformers): decode rows start
at the window's first slot and extend chunks see only the keys their window reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.engine.kv_pool import KVPool
from serving.models.layers.forward_batch import ExtendSeg, ForwardBatch
from serving.models.layers.kv_cache import PAD_SLOT


@dataclass
class Work:
    """One request's share of a step: feed `token_ids` at positions [start, start+n).

    `needs_logits`: its last row's logits (it samples); `score`: rows [a, b) of the chunk whose
    final hidden states are kept for prompt logprobs (row i predicts the token at start+i+1)."""

    row: int
    start: int
    token_ids: list[int]
    needs_logits: bool
    score: tuple[int, int] | None = None


def build_batch(decodes: list[Work], extends: list[Work], pool: KVPool, window: int | None = None) -> ForwardBatch:
    """Allocate KV slots for every fed token and build the attention metadata.

    If it raises, the slots it had allocated are back in the pool.
    """
    slots: list[torch.Tensor] = []
    try:
        return _build(decodes, extends, pool, slots, window)
    except BaseException:
        for s in slots:
            pool.free(s)
        raise


def attended(lengths: torch.Tensor, lmax: int) -> torch.Tensor:
    """[B, lmax] bool: column j of row b is one of the `lengths[b]` positions that row attends."""
    return torch.arange(lmax)[None, :] < lengths[:, None]


def _build(
    decodes: list[Work], extends: list[Work], pool: KVPool, slots: list[torch.Tensor], window: int | None
) -> ForwardBatch:
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    logits_rows: list[int] = []
    score_rows: list[int] = []

    decode_kv_idx = lengths = None
    if decodes:
        rows, starts = [w.row for w in decodes], [w.start for w in decodes]
        ids.extend(w.token_ids[0] for w in decodes)
        slots.append(pool.extend_each(rows, starts))
        pos.append(torch.tensor(starts, dtype=torch.int64))
        lens = [s + 1 if window is None else min(s + 1, window) for s in starts]  # positions each token attends
        lengths, lmax = torch.tensor(lens, dtype=torch.int64), max(lens)
        row_t = torch.tensor(rows, dtype=torch.int64)
        if window is None:
            table = pool.req_to_token[row_t, :lmax]
        else:  # from the window's first position on
            first = torch.tensor([s + 1 - n for s, n in zip(starts, lens)], dtype=torch.int64)
            cols = torch.arange(lmax)[None, :] + first[:, None]
            table = pool.req_to_token[row_t[:, None], cols.clamp(max=pool.req_to_token.shape[1] - 1)]
        decode_kv_idx = table if min(lens) == lmax else torch.where(attended(lengths, lmax), table, PAD_SLOT)

    segs: list[ExtendSeg] = []
    offset = len(decodes)
    logits_rows.extend(range(offset))
    for w in extends:
        n = len(w.token_ids)
        ids.extend(w.token_ids)
        pos.append(torch.arange(w.start, w.start + n, dtype=torch.int64))
        slots.append(pool.extend(w.row, w.start, n))
        total = w.start + n
        first = 0 if window is None else max(0, w.start - window + 1)  # the oldest position any query sees
        segs.append(ExtendSeg(offset, n, pool.slots_of(w.row, total)[first:].clone(), w.start, first, window or 0))
        if w.needs_logits:
            logits_rows.append(offset + n - 1)
        if w.score is not None:
            score_rows.extend(range(offset + w.score[0], offset + w.score[1]))
        offset += n

    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64),
        out_slots=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
        num_decode=len(decodes),
        decode_kv_idx=decode_kv_idx,
        decode_lens=lengths,
        decode_requests=len({w.row for w in decodes}),
        extends=segs,
        # every row when only decode tokens are fed: no gather before the lm_head
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64) if extends else None,
        score_rows=torch.tensor(score_rows, dtype=torch.int64) if score_rows else None,
    )
