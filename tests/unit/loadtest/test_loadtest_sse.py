"""The load test's SSE parsing, on streams recorded from a real server and on hand-written edge cases.

Recorded streams (tests/fixtures/sse/, made by `python -m loadtest.record_fixtures`) are
re-fed in every way a socket could cut them: the events must come out the same as a
whole-body parse, and the request must read as the manifest says (from the request's
own parameters).  Edge cases: keep-alive comments, CRLF, an error event, a cut stream,
a UTF-8 character split across reads.
"""

from __future__ import annotations

import json
import random

import pytest

from loadtest.records import RequestRecord
from loadtest.sse import SSEParser, StreamReader
from tests.helpers import FIXTURES as ALL_FIXTURES
from tests.server_util import sse_events

FIXTURES = ALL_FIXTURES / "sse"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())


def chunkings(body: bytes, seed: int = 0):
    """Whole; one byte at a time; every two-piece cut; random cuts."""
    yield [body]
    yield [body[i : i + 1] for i in range(len(body))]
    for i in range(1, len(body)):
        yield [body[:i], body[i:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(2, 12))))
        yield [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]


def parse(chunks: list[bytes]) -> list:
    p = SSEParser()
    out = [ev for c in chunks for ev in p.feed(c) if ev.kind == "data"]
    return [e.value if e.value == "[DONE]" else json.loads(e.value) for e in out]


def read(chunks: list[bytes]) -> tuple[RequestRecord, StreamReader]:
    """Feed chunk i at t = i + 1 seconds after sending, then end the stream at t = len + 1."""
    rec = RequestRecord("w", "chat", 0, 1.0, 0.0, 0.0)
    reader = StreamReader(rec, sent_at=0.0)
    for i, c in enumerate(chunks):
        reader.feed(c, float(i + 1))
    return reader.finish(float(len(chunks) + 1)), reader


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_recorded_stream_events_survive_any_chunking(name):
    body = (FIXTURES / f"{name}.sse").read_bytes()
    whole = sse_events(body.decode().splitlines())
    assert whole[-1] == "[DONE]" and len(whole) >= 3
    for chunks in chunkings(body):
        assert parse(chunks) == whole


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_recorded_stream_reads_as_the_request_says(name):
    body = (FIXTURES / f"{name}.sse").read_bytes()
    expect = MANIFEST[name]["expect"]
    events = sse_events(body.decode().splitlines())
    texts = [
        i
        for i, e in enumerate(events)
        if isinstance(e, dict)
        and e.get("choices")
        and ((e["choices"][0].get("delta") or {}).get("content") or e["choices"][0].get("text"))
    ]
    # one event per read: event i arrives at t = i + 1, so TTFT names the first event with text
    chunks = [
        b"data: " + line.encode() + b"\n\n" for line in (ev if ev == "[DONE]" else json.dumps(ev) for ev in events)
    ]
    rec, reader = read(chunks)
    assert reader.done is expect["done"]
    assert rec.finish_reason == expect["finish_reason"]
    if expect["error"] == "error event: *":
        assert rec.error.startswith("error event: ") and not rec.ok
    else:
        assert rec.error == expect["error"] and rec.ok
        assert rec.completion_tokens == expect["completion_tokens"]
    if "prompt_tokens" in expect:
        assert rec.prompt_tokens == expect["prompt_tokens"]
    if "status" in expect:  # an error event counts with the status its type stands for
        assert rec.status == expect["status"]
    assert rec.ttft == texts[0] + 1  # the chat role chunk (event 0, no text) is not the first token
    assert rec.chunk_times == [float(i + 1) for i in texts]
    assert rec.e2e == len(chunks) + 1
    if rec.ok and rec.completion_tokens:
        assert rec.tpot == pytest.approx((rec.e2e - rec.ttft) / (rec.completion_tokens - 1))


def _chunk(text: str, finish: str | None = None) -> bytes:
    body = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
        "usage": None,
    }
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_keepalive_comments_and_crlf_in_any_chunking():
    body = (
        b": ping\r\n\r\n"
        + _chunk("a").replace(b"\n", b"\r\n")
        + b": ping\n"
        + _chunk("b", "stop")
        + b":\n\n"
        + USAGE
        + DONE
    )
    for chunks in chunkings(body):
        rec, reader = read(chunks)
        assert rec.ok and rec.finish_reason == "stop" and len(rec.chunk_times) == 2
        assert rec.completion_tokens == 3 and reader.comments == 3


@pytest.mark.parametrize(
    "kind, finish_reason, status",
    [
        ("internal_error", "error", 500),  # the engine failed the request
        ("server_unavailable", "abort", 503),  # the server gave up on it: shutdown, engine restart
        ("timeout", "abort", 504),
    ],
)
def test_error_event_then_done_counts_as_the_server_does(kind, finish_reason, status):
    event = {"error": {"message": "boom", "type": kind, "param": None, "code": None}}
    rec, reader = read([_chunk("a") + b"data: " + json.dumps(event).encode() + b"\n\n" + DONE])
    assert reader.done and not rec.ok
    assert (rec.finish_reason, rec.status, rec.error) == (finish_reason, status, f"error event: {kind}")


@pytest.mark.parametrize(
    "body, error",
    [
        (_chunk("a") + _chunk("b", "length")[:-1], "broken stream: closed mid-event"),
        (_chunk("a") + b'data: {"choi', "broken stream: closed mid-event"),
        (_chunk("a", "length") + USAGE, "broken stream: closed before [DONE]"),
        (b"data: {not json}\n\n" + DONE, "broken stream: invalid JSON in an event"),
        (_chunk("a") + DONE, "broken stream: [DONE] without a finish_reason"),
    ],
)
def test_broken_streams_say_why(body, error):
    rec, _ = read([body])
    assert rec.error == error and not rec.ok


def test_cut_after_the_finish_keeps_the_servers_finish_reason():
    rec, _ = read([_chunk("a", "length")])
    assert rec.finish_reason == "length" and rec.error == "broken stream: closed before [DONE]"


def test_utf8_character_split_across_reads():
    body = _chunk("海の") + _chunk("歌", "stop") + DONE
    for chunks in chunkings(body):
        assert [e["choices"][0]["delta"]["content"] for e in parse(chunks)[:2]] == ["海の", "歌"]


def test_multiline_data_and_events_after_done():
    body = b'data: {"choices": [{"index": 0,\ndata: "text": "x", "finish_reason": "stop"}]}\n\n' + DONE + _chunk("late")
    rec, _ = read([body])
    assert rec.ok and rec.finish_reason == "stop" and rec.chunk_times == [1.0]
