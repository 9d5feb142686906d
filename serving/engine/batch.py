"""One ragged forward batch: decode tokens and prefill (extend) chunks side by side.

Tokens are laid out flat: first one token per decoding request, then each extend
chunk contiguously.  Projections and MLP run once over all of them; attention runs
batched (padded) for the decode group and per chunk for extends, reading K/V from the
paged pool through each request's slot table.
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


def build_batch(decodes: list[Work], extends: list[Work], pool: KVPool) -> ForwardBatch:
    """Allocate KV slots for every fed token and build the attention metadata.

    If it raises, the slots it had allocated are back in the pool.
    """
    slots: list[torch.Tensor] = []
    try:
        return _build(decodes, extends, pool, slots)
    except BaseException:
        for s in slots:
            pool.free(s)
        raise


def _build(decodes: list[Work], extends: list[Work], pool: KVPool, slots: list[torch.Tensor]) -> ForwardBatch:
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    logits_rows: list[int] = []

    for w in decodes:
        ids.append(w.token_ids[0])
        slots.append(pool.extend(w.row, w.start, 1))
    decode_kv_idx = decode_mask = lengths = None
    if decodes:
        lengths = torch.tensor([w.start + 1 for w in decodes], dtype=torch.int64)
        pos.append(lengths - 1)
        lmax = int(lengths.max())
        rows = torch.tensor([w.row for w in decodes], dtype=torch.int64)
        ar = torch.arange(lmax)
        valid = ar[None, :] < lengths[:, None]
        decode_kv_idx = torch.where(valid, pool.req_to_token[rows, :lmax], PAD_SLOT)
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
        mask = None
        if w.start > 0:
            mask = torch.ones((n, total), dtype=torch.bool).tril(diagonal=w.start)
        segs.append(ExtendSeg(offset, n, pool.slots_of(w.row, total).clone(), mask))
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
