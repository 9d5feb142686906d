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
    """One request's share of a step: feed `token_ids` at positions [start, start+n)."""

    row: int
    start: int
    token_ids: list[int]
    needs_logits: bool


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


def _extend_mask(start: int, n: int, first: int, window: int | None) -> torch.Tensor | None:
    """[n, start + n - first] bool: query i (position start+i) sees key j (position first+j) if causal and in
    the window; None when that is plain causal attention from position 0."""
    total = start + n
    if first == 0 and start == 0 and (window is None or window >= n):
        return None
    q = torch.arange(start, total)[:, None]
    k = torch.arange(first, total)[None, :]
    visible = k <= q
    if window is not None:
        visible &= k > q - window
    return visible


def _build(decodes: list[Work], extends: list[Work], pool: KVPool, slots: list[torch.Tensor],
           window: int | None) -> ForwardBatch:
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    logits_rows: list[int] = []

    for w in decodes:
        ids.append(w.token_ids[0])
        slots.append(pool.extend(w.row, w.start, 1))
    decode_kv_idx = decode_mask = lengths = None
    if decodes:
        full = torch.tensor([w.start + 1 for w in decodes], dtype=torch.int64)
        pos.append(full - 1)
        rows = torch.tensor([w.row for w in decodes], dtype=torch.int64)
        lengths = full if window is None else full.clamp(max=window)  # positions each decode token attends
        lmax = int(lengths.max())
        ar = torch.arange(lmax)
        valid = ar[None, :] < lengths[:, None]
        if window is None:
            table = pool.req_to_token[rows, :lmax]
        else:  # from the window's first position on
            cols = ar[None, :] + (full - lengths)[:, None]
            table = pool.req_to_token[rows[:, None], cols.clamp(max=pool.req_to_token.shape[1] - 1)]
        decode_kv_idx = torch.where(valid, table, PAD_SLOT)
        decode_mask = valid[:, None, None, :]
        logits_rows.extend(range(len(decodes)))

    segs: list[ExtendSeg] = []
    offset = len(decodes)
    for w in extends:
        n = len(w.token_ids)
        ids.extend(w.token_ids)
        pos.append(torch.arange(w.start, w.start + n, dtype=torch.int64))
        slots.append(pool.extend(w.row, w.start, n))
        total = w.start + n
        first = 0 if window is None else max(0, w.start - window + 1)  # the oldest position any query sees
        segs.append(ExtendSeg(offset, n, pool.slots_of(w.row, total)[first:].clone(),
                              _extend_mask(w.start, n, first, window)))
        if w.needs_logits:
            logits_rows.append(offset + n - 1)
        offset += n

    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64),
        out_slots=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
        num_decode=len(decodes),
        decode_kv_idx=decode_kv_idx,
        decode_mask=decode_mask,
        decode_lens=lengths,
        extends=segs,
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
    )
