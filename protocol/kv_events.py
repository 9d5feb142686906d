"""The KV-cache events a Scheduler rank publishes for cache-aware routers (`--kv-events-endpoint`).

A wire contract with outside consumers, so it is vLLM's, not ours: the structs, field names,
field order and msgspec options of `vllm/distributed/kv_events.py` at vLLM v0.28.0, so that a
subscriber written for vLLM (llm-d's precise-prefix-cache scorer, NVIDIA Dynamo's KV router)
decodes it unchanged.  The batch is `array_like` (`[ts, events, data_parallel_rank]`); each event
is a map tagged by its class name (`{"type": "BlockStored", ...}`), a tagged union.

Frames on the PUB socket: `(topic, seq, payload)`, `seq` an 8-byte big-endian counter that
starts at 0 and grows by one per batch, `payload` one msgpack `KVEventBatch`.  The replay
socket (ROUTER) takes `(b"", start_seq)` from a DEALER/REQ client and answers every buffered
batch from `start_seq` on as `(b"", seq, payload)`, then `(b"", END_SEQ, b"")`.

Sightline's values: `medium` is `MEDIUM` (the K/V lives in host memory); `lora_id` and
`lora_name` are None (no adapters); `token_ids` is empty unless `--kv-events-token-ids`;
`group_idx` is 0 (one KV cache group).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

MEDIUM = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame: no more batches


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock seconds (time.time()) when the batch was published
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every event: tagged by class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks now cached: `block_hashes[0]` continues `parent_block_hash` (None: from the start)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # the blocks' tokens, block after block (empty unless asked for)
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The rank's whole prefix cache was dropped (POST /flush_cache with nothing running); also the first batch of
    every Scheduler, which starts with an empty cache."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def seq_frame(seq: int) -> bytes:
    """A sequence number as its frame: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big", signed=True)
