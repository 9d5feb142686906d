"""KV-cache events on a real server, read as a router written for vLLM reads them: a plain pyzmq SUB
(bound, as llm-d's indexer binds: the Scheduler connects to it) decoding with vLLM's schema, declared
here again from its documented fields (vllm/distributed/kv_events.py, v0.28.0), block hashes computed
here again from the tokens (sha256 of canonical CBOR, as llm-d's indexer does), a gap filled from the
replay socket, and an endpoint that cannot be opened failing the start with one clear line."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from loadtest.server import free_port
from tests.server_util import ServerProc, scrape, value, wait_until

TOPIC = b"kv@127.0.0.1@tiny"
BLOCK = 16


# -- vLLM's schema, as its documentation declares it -----------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
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
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def block_hashes(tokens: list[int]) -> list[int]:
    """llm-d's ChunkedTokenDatabase with hashSeed "": low 64 bits of sha256 over canonical CBOR, chained."""

    def low64(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")

    def uint(n: int, major: int = 0) -> bytes:
        for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n >= 24 and n < 1 << (8 * size):
                return bytes([major << 5 | info]) + n.to_bytes(size, "big")
        return bytes([major << 5 | n])

    parent, out = low64(b"\x60"), []
    for k in range(len(tokens) // BLOCK):
        block = tokens[k * BLOCK : (k + 1) * BLOCK]
        parent = low64(b"\x83" + uint(parent) + uint(len(block), 4) + b"".join(map(uint, block)) + b"\xf6")
        out.append(parent)
    return out


# -- the server and its subscriber -----------------------------------------------------------------
class Subscriber:
    def __init__(self, ctx: zmq.Context, bind: str | None = None, connect: str | None = None) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's topicFilter
        if bind:
            self.sock.bind(bind)
        else:
            self.sock.connect(connect)
        self.got: list[tuple[int, bytes]] = []  # (seq, payload)

    def resubscribe(self, on: bool) -> None:
        """(Un)subscribe, and give the publisher time to learn it: a SUB sends its subscription only when its
        owner calls into it, and the publisher's thread reads subscriptions between batches."""
        self.sock.setsockopt(zmq.SUBSCRIBE if on else zmq.UNSUBSCRIBE, b"kv@")
        self.warm()

    def warm(self) -> None:
        """Call into the socket for half a second (so its subscription goes out), keeping what arrives."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                self.receive()

    def until(self, predicate, timeout: float = 10.0) -> list[Any]:
        """Receive until `predicate(events so far)`; returns every event received by then."""
        deadline = time.monotonic() + timeout
        while not predicate(self.events()):
            assert self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"no KV event: {self.events()}"
            self.receive()
        return self.events()

    def receive(self) -> None:
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC
        self.got.append((int.from_bytes(seq, "big", signed=True), payload))

    def events(self) -> list[Any]:
        return [ev for _, payload in self.got for ev in DECODE.decode(payload).events]


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="module")
def sub(ctx):
    return Subscriber(ctx, bind=f"tcp://127.0.0.1:{free_port()}")


@pytest.fixture(scope="module")
def replay_ep() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def srv(tmp_path_factory, sub, replay_ep):
    endpoint = sub.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    s = ServerProc(
        "--kv-events-endpoint",
        endpoint,
        "--kv-events-replay-endpoint",
        replay_ep,
        "--kv-events-topic",
        TOPIC.decode(),
        "--kv-events-token-ids",
        "--max-total-tokens",
        "96",
        "--prefix-cache-sharing",
        "salt-only",  # un-salted requests share the namespace a router hashes
        tmpdir=tmp_path_factory.mktemp("kv_events"),
    )
    sub.warm()  # the Scheduler connected during its start: its XPUB learns the subscription now
    yield s
    s.stop()


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from `start` on, as vLLM's subscribers do: (seq, payload) each."""
    with zmq.Context() as c, c.socket(zmq.DEALER) as sock:
        sock.connect(endpoint)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        frames = []
        while not frames or frames[-1][1] != (-1).to_bytes(8, "big", signed=True):
            assert sock.poll(10_000), "the replay ended without its end marker"
            frames.append(sock.recv_multipart())
        sock.setsockopt(zmq.LINGER, 0)
    assert frames[-1][2] == b""
    return [(int.from_bytes(s, "big", signed=True), p) for _, s, p in frames[:-1]]


def generate(srv: ServerProc, ids: list[int]) -> dict:
    r = srv.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    )
    assert r.status_code == 200, r.text
    return r.json()


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def test_a_prompt_s_blocks_are_stored_with_the_hashes_a_router_computes_from_its_tokens(srv, sub, replay_ep):
    ids = list(range(1000, 1040))  # 40 tokens: blocks [0, 16) and [16, 32); the rest is a partial block
    generate(srv, ids)
    events = sub.until(lambda evs: stored(evs))
    (ev,) = stored(events)
    assert ev.block_hashes == block_hashes(ids) and ev.parent_block_hash is None and ev.token_ids == ids[:32]
    assert (ev.block_size, ev.medium, ev.lora_id, ev.lora_name, ev.group_idx) == (16, "CPU", None, None, 0)
    assert all(DECODE.decode(payload).data_parallel_rank == 0 for _, payload in sub.got)
    longer = ids + list(range(2000, 2010))  # 50 tokens: one more whole block, continuing the cached ones
    generate(srv, longer)
    ev = stored(sub.until(lambda evs: len(stored(evs)) == 2))[1]
    assert ev.block_hashes == block_hashes(longer)[2:] and ev.parent_block_hash == block_hashes(ids)[1]
    replayed = replay(replay_ep, 0)  # from the start: the clear every Scheduler begins with, then the stores
    assert isinstance(DECODE.decode(replayed[0][1]).events[0], AllBlocksCleared) and replayed[0][0] == 0
    assert replayed[-len(sub.got) :] == sub.got  # what the subscriber got: the very batches, in order
    # The publisher thread counted every batch before it served the replay; the barrier brings the Scheduler's
    # stats (read after that) to the front end, which otherwise holds those of the last step.
    srv.barrier()
    text = scrape(srv)
    assert value(text, "sightline_kv_events_published_total") == sum(len(DECODE.decode(p).events) for _, p in replayed)
    assert value(text, "sightline_kv_events_dropped_total") == 0


def test_evictions_and_a_flush_are_removed_and_cleared_blocks(srv, sub):
    for base in (3000, 4000):  # a 96-slot pool: the second prompt evicts cached blocks
        generate(srv, list(range(base, base + 60)))
    removed = [
        e for e in sub.until(lambda evs: any(isinstance(e, BlockRemoved) for e in evs)) if isinstance(e, BlockRemoved)
    ]
    cached = {h for e in stored(sub.events()) for h in e.block_hashes}
    assert removed and all(h in cached for e in removed for h in e.block_hashes)
    assert srv.post("/flush_cache", {}).status_code == 200
    assert isinstance(sub.until(lambda evs: isinstance(evs[-1], AllBlocksCleared))[-1], AllBlocksCleared)


def test_a_gap_in_the_sequence_numbers_is_filled_from_the_replay_socket(srv, sub, replay_ep):
    """The subscriber stops listening while one prompt's blocks are published: the next batch it gets skips a
    sequence number, and the replay socket gives back the missed batch, byte for byte as published."""

    def published() -> float:
        srv.barrier()  # the Scheduler's current count, not the one its last step reported
        return value(scrape(srv), "sightline_kv_events_published_total")

    sub.resubscribe(False)
    before = published()
    missed = list(range(5000, 5040))
    generate(srv, missed)
    wait_until(lambda: published() > before, 10, "the missed prompt's batch sent")
    sub.resubscribe(True)
    last = sub.got[-1][0]
    generate(srv, list(range(6000, 6040)))
    sub.until(lambda evs: sub.got[-1][0] > last)
    assert sub.got[-1][0] == last + 2  # one batch missed
    replayed = replay(replay_ep, last + 1)
    assert [seq for seq, _ in replayed] == [last + 1, last + 2] and replayed[1][1] == sub.got[-1][1]
    (gap,) = DECODE.decode(replayed[0][1]).events
    assert isinstance(gap, BlockStored) and gap.block_hashes == block_hashes(missed)


def test_an_endpoint_that_cannot_be_opened_fails_the_start_with_one_clear_line(srv, sub, replay_ep, tmp_path):
    taken = replay_ep  # bound by the running server
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        ServerProc(
            "--kv-events-endpoint",
            sub.sock.getsockopt(zmq.LAST_ENDPOINT).decode(),
            "--kv-events-replay-endpoint",
            taken,
            tmpdir=tmp_path,
            startup=60,
        )
    assert f"error: KV-events replay endpoint {taken}: Address already in use" in str(err.value)
    assert "could not open its KV-events endpoint" in str(err.value)
    assert time.monotonic() - t0 < 45  # before the model loads, not a hang
    assert httpx.get(srv.url + "/health").status_code == 200  # the first server serves on
