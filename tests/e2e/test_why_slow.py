"""Why a request waited and why a stream stalled, on one real server of a seeded small Llama (its context
is long enough for a prefill that dwarfs any decode step's noise): a long prefill beside two
streams is their decode gap and is named as the culprit (span event, counter moved by exactly those gaps);
a request held back by the running limit and a pause says so, its reasons summing to its queue time; and
GET /debug/timeline is Chrome Trace Event JSON whose steps lead to those requests' trace ids.

Which step does what is fixed by the order requests reach a stopped Scheduler and by held requests
(tests.server_util.HOLD), not by how fast the engine is."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

import httpx
import pytest

from tests import family_models
from tests.e2e.test_debug_ui import Rows, chromium, headless
from tests.server_util import HOLD, ServerProc, samples, scrape, sse_events, wait_until

LONG_PROMPT = 4000  # tokens: one prefill chunk, tens of decode steps' time
FIRST = 6  # tokens of the request that holds the third running place until the long prompt's turn
STREAM_TOKENS = 32  # the streams decode on well past that step
HELD_TOKENS = 8  # of the held streams: they stream 7, then wait to be released
SEEN: dict[str, str] = {}  # what the first test made, for the inspector's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(
        "--max-running-requests",
        "3",
        "--max-prefill-tokens",
        "4096",
        "--max-step-tokens",
        "4096",
        "--step-time-factor",
        "0",  # the token caps alone: a prompt's chunks do not depend on how fast this machine is
        "--decode-gap-factor",
        "3",
        "--decode-gap-floor",
        "0.005",
        "--heartbeat-interval",
        "0.2",
        model=str(family_models.build("llama")),
        tmpdir=tmp_path_factory.mktemp("why"),
    )
    yield srv
    srv.stop()


class Stream(threading.Thread):
    """A streamed greedy /generate of `n` tokens in the background; `hold`: the hold seam keeps it running one
    token short of `n` until released (or cut)."""

    def __init__(self, srv: ServerProc, ids: list[int], n: int, hold: bool = False) -> None:
        super().__init__(daemon=True)
        self.srv, self.n = srv, n
        self.body = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **(HOLD if hold else {})},
        }
        self.events: list = []
        self.rid = self.traceparent = None
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.srv.url + "/generate", json=self.body, timeout=300) as r:
            self.rid, self.traceparent = r.headers["x-request-id"], r.headers.get("traceparent")
            for line in r.iter_lines():
                self.events += sse_events([line])

    def tokens(self) -> int:
        """Output tokens streamed so far."""
        got = [e for e in self.events if isinstance(e, dict) and "output_ids" in e]
        return len(got[-1]["output_ids"]) if got else 0


def counter(srv: ServerProc, name: str, **labels: str) -> float:
    return sum(
        s.value for s in samples(scrape(srv)) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def entry(srv: ServerProc, rid: str, span: str) -> dict:
    """The rid's /debug/requests entry with the engine's `span` in it (the children's spans come with their
    stats: after the barrier they are in; the wait is for the front end's own record of a request just ended)."""
    srv.barrier()

    def got():
        r = httpx.get(f"{srv.url}/debug/requests/{rid}")
        return r.status_code == 200 and any(s["name"] == span for s in r.json()["spans"]) and r.json()

    return wait_until(got, 20, f"{rid}'s {span} span")


def generate(srv: ServerProc, ids: list[int], n: int) -> httpx.Response:
    return srv.post(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
        timeout=300,
    )


def waiting(srv: ServerProc, n: int) -> None:
    """Wait until `n` requests wait in the Scheduler's queue (they arrive over HTTP: polled)."""
    wait_until(lambda: srv.barrier() or srv.debug()["scheduler"]["num_waiting"] == n, 30, f"{n} requests waiting")


@contextmanager
def scheduler_stopped(srv: ServerProc):
    """The Scheduler stopped (SIGSTOP) for the block: what is sent meanwhile waits on its socket, in the order
    sent (`sent_on`), and it takes it all in that order once it runs on."""
    pid = srv.debug()["pids"]["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def sent_on(srv: ServerProc, n: int) -> None:
    """Wait until the front end holds `n` requests: it sends each on to the Scheduler in the step that adds it."""
    wait_until(
        lambda: len(httpx.get(srv.url + "/debug/requests", params={"in_flight": 1}).json()["requests"]) == n,
        30,
        f"{n} requests sent on to the Scheduler",
    )


def test_a_long_prefill_is_the_streams_gap_and_the_timeline_links_it(server):
    """To a stopped Scheduler go a short request, two streams and the long prompt, in that order.  Run on, it
    admits the first three (the running limit); the long prompt waits for the short one's last token (its
    FIRST-th step), then is prefilled in one step beside the two streams, which decode on to STREAM_TOKENS."""
    done: dict = {}

    def call(name: str, ids: list[int], n: int) -> threading.Thread:
        t = threading.Thread(target=lambda: done.setdefault(name, generate(server, ids, n)), daemon=True)
        t.start()
        return t

    server.barrier()
    before = counter(server, "sightline_decode_gaps_total", cause="prefill")
    with scheduler_stopped(server):
        first = call("first", [2, 3, 4], FIRST)
        sent_on(server, 1)
        streams = []
        for i in range(2):
            streams.append(Stream(server, [5 + i, 6, 7, 8], STREAM_TOKENS))
            sent_on(server, 2 + i)
        long = call("long", [3 + j % 900 for j in range(LONG_PROMPT)], 2)
        sent_on(server, 4)
    for t in (first, long, *streams):
        t.join(300)
    r = done["long"]
    assert r.status_code == 200 and done["first"].status_code == 200, r.text
    assert all(s.events[-1] == "[DONE]" and s.tokens() == STREAM_TOKENS for s in streams)
    long_rid = r.headers["x-request-id"]
    gaps, every = [], []  # the prefill gaps of every request that decoded after `before`, and all their gaps
    for rid in (done["first"].headers["x-request-id"], *(s.rid for s in streams)):
        decode = next(x for x in entry(server, rid, "decode")["spans"] if x["name"] == "decode")
        every += [
            (e["attributes"]["sightline.decode_gap.cause"], e["attributes"]["sightline.decode_gap.seconds"])
            for e in decode["events"]
            if e["name"] == "decode_gap"
        ]
        gaps += [
            (rid, e)
            for e in decode["events"]
            if e["name"] == "decode_gap" and e["attributes"]["sightline.decode_gap.cause"] == "prefill"
        ]
    by_long = [(rid, g) for rid, g in gaps if long_rid in g["attributes"]["sightline.decode_gap.culprit_rids"]]
    assert sorted(rid for rid, _ in by_long) == sorted(s.rid for s in streams), (gaps, every)  # one each
    assert all(g["attributes"]["sightline.decode_gap.prefill_tokens"] >= LONG_PROMPT for _, g in by_long)
    SEEN.update(stream=streams[0].rid, long=long_rid)
    # The counter moves by exactly the prefill gaps these requests' spans show: the long prompt's in each
    # stream, and any a stream's own prefill made in the requests before it (a stopped Scheduler's socket
    # may hand it the four requests over more than one step).
    server.barrier()  # the Scheduler's counts of every step so far
    moved = counter(server, "sightline_decode_gaps_total", cause="prefill") - before
    assert moved == len(gaps), (moved, gaps, every)

    timeline = httpx.get(server.url + "/debug/timeline?seconds=300").json()
    events = timeline["traceEvents"]
    assert events and all({"ph", "pid", "tid", "name"} <= set(e) for e in events)
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert steps and all(isinstance(e["ts"], float) and e["dur"] > 0 and e["pid"] == 0 for e in steps)
    assert [e["ts"] for e in steps] == sorted(e["ts"] for e in steps)
    long_step = [e for e in steps if long_rid in e["args"]["prefill_rids"]]
    assert len(long_step) == 1 and long_step[0]["args"]["prefill_tokens"] >= LONG_PROMPT
    assert {"schedule", "forward", "sample", "output"} & {e["name"] for e in events if e.get("cat") == "phase"}
    for s in streams:  # every stream's steps are one flow, its id the stream's trace id
        trace_id = s.traceparent.split("-")[1]
        flow = [e for e in events if e["ph"] in ("s", "t", "f") and e["id"] == trace_id]
        assert flow[0]["ph"] == "s" and flow[-1]["ph"] == "f" and len(flow) == STREAM_TOKENS, flow[:3]
        assert all(e["args"]["rid"] == s.rid for e in flow)
        assert trace_id in long_step[0]["args"]["trace_ids"]  # the streams decoded beside the long prefill


def test_the_inspector_marks_the_gap_and_links_the_culprit(server, tmp_path):
    browser = chromium()
    if not SEEN:
        pytest.skip("needs the gap of test_a_long_prefill_is_the_streams_gap_and_the_timeline_links_it")
    dom = headless(browser, tmp_path, f"{server.url}/debug/ui#rid={SEEN['stream']}", "--dump-dom")
    parsed = Rows()
    parsed.feed(dom)
    gaps = [r for r in parsed.rows if r.get("data-source") == "gap"]
    assert any(r["data-cause"] == "prefill" and SEEN["long"] in r["data-culprits"].split() for r in gaps), gaps
    rows = dom.split('class="row"')
    assert any(
        'data-source="gap"' in r and 'data-cause="prefill"' in r and f'data-rid="{SEEN["long"]}"' in r for r in rows
    )  # the gap's row links to the culprit's own page


def test_held_back_by_the_running_limit_and_a_pause(server):
    def reasons_count(reason):
        return counter(server, "sightline_request_wait_seconds_count", reason=reason)

    server.barrier()
    paused_before = reasons_count("paused")
    # the running limit, taken by three held streams: running until released, whatever the machine
    streams = [Stream(server, [9 + i, 6, 7], HELD_TOKENS, hold=True) for i in range(3)]
    server.wait_held(3)
    wait_until(lambda: all(s.tokens() == HELD_TOKENS - 1 for s in streams), 30, "all but the last token streamed")
    done: dict = {}
    waiter = threading.Thread(target=lambda: done.setdefault("r", generate(server, [4, 5, 6], 4)), daemon=True)
    waiter.start()
    waiting(server, 1)
    assert server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    wait_until(lambda: server.debug()["scheduler"]["paused"], 10, "the pause in effect")
    assert server.post("/continue_generation", {}).status_code == 200
    assert server.held() == 3 and "r" not in done  # still the running limit after the pause
    server.release(streams[0].rid)  # it ends, which frees a place: the fourth request runs
    waiter.join(300)
    streams[0].join(30)
    assert server.held() == 2 and streams[0].events[-1] == "[DONE]" and streams[0].tokens() == HELD_TOKENS
    server.release()
    for s in streams:
        s.join(30)
        assert s.events[-1] == "[DONE]" and s.tokens() == HELD_TOKENS
    assert done["r"].status_code == 200 and len(done["r"].json()["output_ids"]) == 4, done["r"].text
    breakdown = done["r"].json()["meta_info"]["sightline"]
    waits = breakdown["wait_ms"]
    assert set(waits) == {"running_limit", "paused"} and waits["running_limit"] > 0 and waits["paused"] > 0, waits
    assert abs(sum(waits.values()) - breakdown["queue_ms"]) < 0.01 * len(waits), breakdown
    server.barrier()
    assert reasons_count("paused") == paused_before + 1  # one paused wait observed
    # the caller sees the same numbers in Server-Timing; the server span carries them as vLLM names them
    timing = dict(part.split(";dur=") for part in done["r"].headers["server-timing"].split(", "))
    assert set(timing) == {"queue", "prefill", "decode", "tokenize", "total"}, timing
    assert abs(float(timing["queue"]) - breakdown["queue_ms"]) < 0.002 and float(timing["total"]) > 0
    rid = done["r"].headers["x-request-id"]
    (root,) = [x for x in entry(server, rid, "queue")["spans"] if x["kind"] == "SERVER"]
    attrs = root["attributes"]
    assert abs(attrs["gen_ai.latency.time_in_queue"] * 1e3 - breakdown["queue_ms"]) < 0.002
    assert {
        "gen_ai.latency.time_to_first_token",
        "gen_ai.latency.e2e",
        "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode",
        "gen_ai.latency.time_in_model_inference",
    } <= set(attrs)
    assert attrs["sightline.wait.paused_seconds"] > 0
