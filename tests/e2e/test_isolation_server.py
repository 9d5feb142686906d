"""One request must never hurt another, in a real server: engine faults and malformed IPC.

A request that fails inside the engine step (made to, through the documented
SIGHTLINE_FAULT_SEED seam) ends alone with an explicit error while its batch mates, decoding
in that very step (the step floor keeps their tokens flowing; the step timeline shows them
there), stream on to `length` with the tokens they produce alone.  Crafted msgpack messages
written straight to the Scheduler's and the Detokenizer's sockets (same user: the sockets'
permissions hold) end the rid they name, explicitly, and never the process: the streams
running beside them are held (the hold seam) when those arrive, and finish once released.
"""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import pytest

from protocol.io_struct import (
    AbortReq,
    BatchTokenIDOutput,
    DetokParams,
    ReqMeta,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenOut,
)
from protocol.sampling_params import SamplingParams
from tests.server_util import HOLD, ServerProc, push, wait_until

FAULT_SEED = 4242
GOOD = 3
N = 32  # each stream's tokens; held ones stop at N - 1 until released
FLOOR_MS = 80  # the step floor: a stream decodes for at least (N - 1) * 80 ms, about 2.5 s, before it is held


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(
        "--pooling",
        "last",
        tmpdir=tmp_path_factory.mktemp("isolation"),
        env={"SIGHTLINE_FAULT_SEED": str(FAULT_SEED)},
        step_floor_ms=FLOOR_MS,
    )
    yield srv
    srv.stop()


def prompt(i: int) -> list[int]:
    return [100 + i, 200 + i, 300 + i, 400 + i]


def generate(srv: ServerProc, ids: list[int], **sp) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True, **sp}}
    return srv.post("/generate", body)


class Stream:
    """A held greedy /generate stream in a thread (it stops at n - 1 tokens until released); `started` is
    set at its first event."""

    def __init__(self, srv: ServerProc, ids: list[int], n: int = N) -> None:
        self.srv, self.ids, self.n = srv, ids, n
        self.started = threading.Event()
        self.events: list = []
        self.rid: str | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        body = {
            "input_ids": self.ids,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": self.n, **HOLD},
        }
        try:
            with httpx.stream("POST", self.srv.url + "/generate", json=body, timeout=120) as r:
                self.rid = r.headers.get("x-request-id")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        finally:
            self.started.set()

    def join(self) -> list:
        self.thread.join(120)
        assert not self.thread.is_alive(), "a stream hung"
        return self.events


@functools.cache
def _reference(url: str, i: int) -> tuple[int, ...]:
    r = httpx.post(
        url + "/generate",
        json={"input_ids": prompt(i), "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": N}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return tuple(r.json()["output_ids"])


def reference(srv: ServerProc, i: int) -> list[int]:
    """The greedy tokens of prompt(i) alone (unheld), once per server."""
    return list(_reference(srv.url, i))


def start_held(srv: ServerProc, n: int = GOOD) -> list[Stream]:
    """`n` held streams, each with all but its last token sent."""
    streams = [Stream(srv, prompt(i)) for i in range(n)]
    srv.wait_held(n)
    return streams


def assert_finished_normally(stream: Stream, expected: list[int]) -> None:
    events = stream.join()
    assert events[-1] == "[DONE]", events[-3:]
    last = events[-2]
    assert "error" not in last, last
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"] == expected and len(expected) == N  # the same tokens as alone: nothing leaked


def stale(srv: ServerProc, component: str, message_type: str) -> int:
    return sum(d[3] for d in srv.debug()["stale_drops"] if d[0] == component and d[1] == message_type)


def wait_for(cond, timeout: float = 20.0) -> None:
    """Poll what the test's own messages cause: they reach the sockets on connections of their own, so no
    barrier orders them."""
    wait_until(cond, timeout, "the condition")


def steps_with(srv: ServerProc, rid: str) -> list[dict]:
    """The engine steps (GET /debug/timeline) that ran `rid` (the engine's rid starts with the HTTP one)."""
    events = httpx.get(srv.url + "/debug/timeline?seconds=60", timeout=30).json()["traceEvents"]
    return [e["args"] for e in events if e.get("name") == "step" and any(r.startswith(rid) for r in e["args"]["rids"])]


def assert_still_serving(srv: ServerProc) -> None:
    assert srv.debug()["pids"] == srv.pids  # neither child died or was replaced
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    r = generate(srv, prompt(9), max_new_tokens=4)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


def release_untouched(server, streams, expected) -> dict:
    """The held streams are all still running and nothing waits; released, each ends as its reference
    did; /debug/state afterwards."""
    server.barrier()
    state = server.debug()["scheduler"]
    assert state["num_running"] == state["held"] == GOOD and state["num_waiting"] == 0
    server.release()
    for s, ids in zip(streams, expected):
        assert_finished_normally(s, ids)
    server.barrier()
    return server.debug()


def test_edge_rejects_out_of_range_sampling_params(server):
    for sp, field in (({"top_k": 2**64 - 1}, "top_k"), ({"stop_token_ids": list(range(65))}, "stop_token_ids")):
        r = generate(server, prompt(0), max_new_tokens=4, **sp)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)


def test_engine_failure_ends_only_its_request(server):
    expected = [reference(server, i) for i in range(GOOD)]
    streams = [Stream(server, prompt(i)) for i in range(GOOD)]
    for s in streams:
        assert s.started.wait(60)  # decoding, one token a step floor, for seconds more
    body = {"prompt": prompt(5), "max_tokens": 8, "seed": FAULT_SEED}
    bad = server.post("/v1/completions", body)
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "internal_error" and "engine error" in err["message"]
    server.wait_held(GOOD)  # the streams went on decoding to their last token but one
    # the step that failed ran the culprit's prefill with every stream decoding beside it
    failed = steps_with(server, bad.headers["x-request-id"])
    assert len(failed) == 1 and failed[0]["decode"] == GOOD, failed
    assert {s.rid for s in streams} <= set(failed[0]["rids"]), (failed, [s.rid for s in streams])
    assert all("[DONE]" not in s.events for s in streams)
    server.release()
    for s, ids in zip(streams, expected):
        assert_finished_normally(s, ids)
    assert_still_serving(server)


def test_scheduler_survives_malformed_requests(server):
    expected = [reference(server, i) for i in range(GOOD)]
    before = stale(server, "tokenizer_manager", "BatchStrOutput")
    streams = start_held(server)
    bad = [  # each once reached the engine or broke its intake; each is the TM's to refuse in normal use
        SamplingParams(max_new_tokens=8, temperature=1.0, top_k=2**64 - 1),
        SamplingParams(max_new_tokens=8, stop_token_ids=list(range(100_000))),
        SamplingParams(max_new_tokens=8, temperature=float("nan")),
    ]
    push(
        server,
        "scheduler",
        *(
            TokenizedGenerateReqInput(
                rid=f"raw-{i}", input_ids=prompt(i), sampling=sp, detok=DetokParams(), meta=ReqMeta()
            )
            for i, sp in enumerate(bad)
        ),
        TokenizedGenerateReqInput(
            rid="raw-empty", input_ids=[], sampling=SamplingParams(), detok=DetokParams(), meta=ReqMeta()
        ),
        AbortReq(rid="raw-unknown", reason="client_disconnect"),
    )
    # each refused rid got an explicit final output; the TM, which never sent them, counts it stale
    wait_for(lambda: stale(server, "tokenizer_manager", "BatchStrOutput") - before == len(bad) + 1)
    st = release_untouched(server, streams, expected)  # the streams untouched
    assert st["scheduler"]["num_running"] == 0 and st["detokenizer"]["active_rids"] == 0
    assert stale(server, "tokenizer_manager", "BatchStrOutput") - before == len(bad) + 1
    assert_still_serving(server)


def test_an_embedding_input_that_fails_ends_its_whole_request_alone(server):
    """Several inputs of one embeddings request run as several engine requests: one that fails
    (too long for the context; an id past the vocabulary) ends the whole request with one explicit
    error, its sibling inputs are dropped with their KV, and the streams beside them go on."""
    expected = [reference(server, i) for i in range(GOOD)]
    before = stale(server, "tokenizer_manager", "BatchStrOutput")
    streams = start_held(server)
    bad = [
        TokenizedEmbeddingReqInput(
            rid="emb-long", inputs=[prompt(1), prompt(2), list(range(1, 5000))], pooling="last", meta=ReqMeta()
        ),
        TokenizedEmbeddingReqInput(
            rid="emb-vocab", inputs=[prompt(3), [100, 10**9, 300], prompt(4)], pooling="last", meta=ReqMeta()
        ),
    ]
    push(server, "scheduler", *bad)
    # one explicit final output per request (the TM, which never sent them, counts each stale)
    wait_for(lambda: stale(server, "tokenizer_manager", "BatchStrOutput") - before == len(bad))
    st = release_untouched(server, streams, expected)["scheduler"]  # the siblings dropped
    assert st["num_running"] == 0 and st["num_waiting"] == 0
    assert st["kv_used"] == st["prefix_cached_tokens"] and st["kv_reserved"] == 0  # no KV left behind
    ok = server.post("/v1/embeddings", {"input": [prompt(3), prompt(4)], "model": "tiny-random"})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 2, ok.text
    assert_still_serving(server)


def test_detokenizer_survives_undecodable_tokens(server):
    expected = reference(server, 0)
    good, victim = Stream(server, prompt(0)), Stream(server, prompt(1))  # both held: running when it arrives
    server.wait_held(2)
    assert victim.rid
    errors_before = server.debug()["detokenizer"].get("handling_errors", 0)
    push(
        server,
        "detokenizer",
        BatchTokenIDOutput(
            outputs=[
                TokenOut(rid=victim.rid, new_token_ids=[2**40]),  # a live rid: it must end, explicitly
                TokenOut(rid="raw-tail", new_token_ids=[5], detok=DetokParams(prompt_tail=[2**40])),  # a new rid
            ]
        ),
    )
    events = victim.join()
    assert events[-1] == "[DONE]" and "could not be detokenized" in events[-2]["error"]["message"]
    server.barrier()  # the victim's abort has reached the Scheduler, the Detokenizer's counters /debug
    state = server.debug()
    assert state["scheduler"]["num_running"] == state["scheduler"]["held"] == 1  # only the good stream is left
    assert state["detokenizer"]["handling_errors"] - errors_before == 2
    assert "[DONE]" not in good.events
    server.release()
    assert_finished_normally(good, expected)
    server.barrier()
    assert server.debug()["scheduler"]["num_running"] == 0
    assert_still_serving(server)


def test_a_flood_of_bad_outputs_logs_a_line_a_second(server):
    marker = "could not detokenize the output of request"
    time.sleep(1.2)  # clock: past the previous line's one-second rate-limit window
    lines = server.log().count(marker)
    burst = [
        TokenOut(rid=f"flood-{i}", new_token_ids=[2**40], finish_reason="length", detok=DetokParams())
        for i in range(30)
    ]
    push(server, "detokenizer", BatchTokenIDOutput(outputs=burst))
    wait_for(lambda: server.debug()["detokenizer"]["handling_errors"] >= 30 and server.log().count(marker) > lines)
    time.sleep(1.2)  # clock: past this burst's one-second rate-limit window
    push(server, "detokenizer", BatchTokenIDOutput(outputs=burst[:1]))
    wait_for(lambda: server.log().count(marker) == lines + 2)
    assert "(29 more since the previous line)" in server.log().split(marker)[-1]
    assert_still_serving(server)
