"""KV-cache events: the block hashes (vLLM's sha256_cbor, as llm-d's indexer computes them), what the radix
tree's insertions, evictions and resets become, and the publisher's framing, replay and drops."""

from __future__ import annotations

import hashlib
import threading

import msgspec
import pytest
import torch
import zmq

from protocol.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, seq_frame
from serving.engine.kv_event_publisher import KVEventPublisher, KVEventsError, offset_endpoint
from serving.engine.kv_events import BlockHasher, KVEventRecorder, cbor
from serving.engine.radix_cache import RadixCache
from tests.server_util import wait_until

DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def test_block_hashes_are_sha256_of_canonical_cbor_as_llm_d_computes_them():
    # the bytes written out by hand from RFC 8949: text "" is 0x60; [parent, [1, 2, 3, 300], null] is
    # 0x83, a uint64 (0x1b + 8 bytes), 0x84 1 2 3 (0x19 0x01 0x2c), 0xf6
    root = low64(b"\x60")
    hasher = BlockHasher(4, seed="")
    assert hasher.root == root
    first = low64(b"\x83\x1b" + root.to_bytes(8, "big") + b"\x84\x01\x02\x03\x19\x01\x2c\xf6")
    second = low64(b"\x83\x1b" + first.to_bytes(8, "big") + b"\x84\x18\x18\x17\x16\x15\xf6")
    assert hasher.chain([1, 2, 3, 300, 24, 23, 22, 21, 9], "", 2) == [first, second]
    # a namespace is the first block's extra key, ["t"]: 0x81 0x61 "t"
    salted = low64(b"\x83\x1b" + root.to_bytes(8, "big") + b"\x84\x01\x02\x03\x19\x01\x2c\x81\x61t")
    assert hasher.chain([1, 2, 3, 300], "t", 1) == [salted]
    assert BlockHasher(4, seed="42").root == low64(b"\x6242")
    assert cbor(2**64 - 1) == b"\x1b" + b"\xff" * 8 and cbor(23) == b"\x17" and cbor(24) == b"\x18\x18"


def recorded() -> tuple[RadixCache, KVEventRecorder]:
    tree, rec = RadixCache(), KVEventRecorder(block_size=4, token_ids=True)
    tree.events = rec
    return tree, rec


def test_insertions_store_each_block_once_with_its_parent():
    tree, rec = recorded()
    ids = list(range(100, 110))  # blocks [0, 4) and [4, 8); 8, 9 are a partial block
    tree.insert(ids, torch.arange(10))
    (ev,) = rec.drain()
    h = rec.hasher.chain(ids, "", 2)
    assert ev == BlockStored(
        block_hashes=h,
        parent_block_hash=None,
        token_ids=ids[:8],
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )
    tree.insert(ids + [110, 111, 112], torch.arange(13))  # completes block [8, 12)
    (ev,) = rec.drain()
    assert ev.parent_block_hash == h[1] and ev.token_ids == [108, 109, 110, 111]
    assert ev.block_hashes == rec.hasher.chain(ids + [110, 111], "", 3)[2:]
    tree.insert(ids, torch.arange(10))  # already held: nothing new
    tree.insert([100, 101, 102], torch.arange(3))  # no whole block
    assert rec.drain() == []


def test_evictions_remove_the_blocks_whose_end_left_and_a_reset_clears_all():
    tree, rec = recorded()
    shared = list(range(8))
    tree.insert(shared + [50, 51, 52, 53], torch.arange(12))
    tree.insert(shared + [60, 61], torch.arange(20, 30)[:10])
    stored = rec.drain()
    assert [len(e.block_hashes) for e in stored] == [3]  # the second adds no whole block
    _, node = tree.match_prefix(shared + [60, 61])
    tree.inc_lock(node)
    tree.evict(4)  # only the unlocked leaf [8, 12) can go
    (ev,) = rec.drain()
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == stored[0].block_hashes[2:]
    tree.dec_lock(node)
    tree.reset()
    assert rec.drain() == [AllBlocksCleared()]


def test_tenants_blocks_never_share_a_hash_and_token_ids_stay_home_unless_asked():
    tree, rec = RadixCache(), KVEventRecorder(block_size=4)
    tree.events = rec
    ids = list(range(8))
    for ns in ("", "a", "b"):
        tree.insert(ids, torch.arange(8), ns)
    events = rec.drain()
    hashes = [tuple(e.block_hashes) for e in events]
    assert len(set(hashes)) == 3 and all(e.token_ids == [] for e in events)


def sub(ctx: zmq.Context, endpoint: str, hwm: int = 1000) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.set_hwm(hwm)  # before connecting: a pipe takes the options of its sockets when it is made
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def test_publisher_frames_topic_seq_payload_and_replays_from_a_sequence_number():
    ctx = zmq.Context()
    pub = KVEventPublisher("inproc://kv", "inproc://kv-replay", topic="kv@pod@m", rank=3, ctx=ctx)
    assert (pub.endpoint, pub.replay_endpoint) == ("inproc://kv_dp3", "inproc://kv-replay_dp3")  # rank 3's
    s = sub(ctx, pub.endpoint)
    try:
        probes = subscribed(pub, s)
        stored = BlockStored(
            block_hashes=[1],
            parent_block_hash=None,
            token_ids=[],
            block_size=16,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        removed = BlockRemoved(block_hashes=[1], medium="CPU")
        pub.publish([stored])
        pub.publish([removed])
        got = [s.recv_multipart() for _ in range(2)]
        assert [(topic, seq) for topic, seq, _ in got] == [
            (b"kv@pod@m", seq_frame(probes)),
            (b"kv@pod@m", seq_frame(probes + 1)),
        ]
        batches = [DECODE.decode(payload) for _, _, payload in got]
        assert [b.events for b in batches] == [[stored], [removed]] and {b.data_parallel_rank for b in batches} == {3}
        replay = ctx.socket(zmq.DEALER)
        replay.connect(pub.replay_endpoint)
        replay.send_multipart((b"", seq_frame(probes)))  # a subscriber that missed both asks from the first
        frames = [replay.recv_multipart() for _ in range(3)]
        assert [f[1] for f in frames] == [seq_frame(probes), seq_frame(probes + 1), END_SEQ]
        assert [f[2] for f in frames] == [got[0][2], got[1][2], b""]  # the very payloads sent
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_a_subscriber_that_does_not_read_never_blocks_the_publisher_and_its_drops_are_counted():
    ctx = zmq.Context()
    pub = KVEventPublisher("inproc://slow", hwm=1, ctx=ctx)
    s = sub(ctx, "inproc://slow", hwm=1)
    try:
        before = subscribed(pub, s)
        done = threading.Event()

        def flood() -> None:
            for _ in range(200):
                pub.publish([AllBlocksCleared()])
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(5), "publish() waited for the subscriber"
        wait_until(lambda: pub.published + pub.dropped == before + 200, 10, "every batch sent or dropped")
        assert pub.dropped > 0 and pub.stats() == {
            "kv_events_published_total": pub.published,
            "kv_events_dropped_total": pub.dropped,
        }
    finally:
        pub.close()
        ctx.destroy(linger=0)


def subscribed(pub: KVEventPublisher, s: zmq.Socket) -> int:
    """Publish probes (AllBlocksCleared) until one reaches the subscriber (its subscription is in place) and the
    publisher has sent or dropped every one; returns how many."""
    probes = [0]

    def probe() -> bool:
        pub.publish([AllBlocksCleared()])
        probes[0] += 1
        if s.poll(50):
            s.recv_multipart()
            return True
        return False

    wait_until(probe, 5, "the subscription in place")
    wait_until(lambda: pub.published + pub.dropped == probes[0], 5, "the probes sent")
    return probes[0]


def test_a_taken_or_foreign_address_and_no_subscriber_to_connect_to_fail_at_once():
    ctx = zmq.Context()
    first = KVEventPublisher("tcp://127.0.0.1:*", ctx=ctx)  # any free port: bound (a wildcard)
    try:
        port = first._pub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        with pytest.raises(KVEventsError, match="Address already in use"):
            KVEventPublisher(f"tcp://*:{port}", ctx=ctx)
        with pytest.raises(KVEventsError, match="replay endpoint"):
            KVEventPublisher("inproc://fine", f"tcp://*:{port}", ctx=ctx)
        with pytest.raises(KVEventsError, match="within 0.2 s"):
            KVEventPublisher("tcp://127.0.0.1:1", connect_timeout=0.2, ctx=ctx)  # nobody listens on port 1
    finally:
        first.close()
        ctx.destroy(linger=0)


def test_each_rank_offsets_the_port_as_vllm_does():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://router:5557", 2) == "tcp://router:5559"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(KVEventsError):
        offset_endpoint("tcp://router", 1)


def test_flags_that_cannot_work_are_refused_before_any_process_starts():
    from serving.args import ServerArgs

    with pytest.raises(ValueError, match="--kv-events-endpoint must be a ZMQ endpoint"):
        ServerArgs(kv_events_endpoint="router:5557")
    with pytest.raises(ValueError, match="needs the prefix cache"):
        ServerArgs(kv_events_endpoint="tcp://*:5557", disable_prefix_cache=True)
    with pytest.raises(ValueError, match="--kv-events-block-size"):
        ServerArgs(kv_events_endpoint="tcp://*:5557", kv_events_block_size=0)
