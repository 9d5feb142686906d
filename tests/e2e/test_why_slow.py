"""Why a request waited and why a stream stalled, on one real server of a seeded small Llama (its context
is long enough for a prefill that dwarfs any decode step's noise): a long prefill beside two
streams is their decode gap and is named as the culprit (span event, counter moved by exactly those gaps);
a request held back by the running limit and a pause says so, its reasons summing to its queue time; and
GET /debug/timeline is Chrome Trace Event JSON whose steps lead to those requests' trace ids."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests import family_models
from tests.e2e.test_debug_ui import Rows, chromium, headless
from tests.server_util import ServerProc, samples, scrape, sse_events, wait_until

LONG_PROMPT = 4000  # tokens: one prefill chunk, tens of decode steps' time
SEEN: dict[str, str] = {}  # what the first test made, for the inspector's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--max-running-requests", "3", "--max-prefill-tokens", "4096", "--max-step-tokens", "4096",
                     "--decode-gap-factor", "3", "--decode-gap-floor", "0.005", "--heartbeat-interval", "0.2",
                     model=str(family_models.build("llama")), tmpdir=tmp_path_factory.mktemp("why"))
    yield srv
    srv.stop()


class Stream(threading.Thread):
    def __init__(self, srv: ServerProc, ids: list[int], n: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.n = srv, n
        self.body = {"input_ids": ids, "stream": True,
                     "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        self.events: list = []
        self.rid = self.traceparent = None
        self.cut = threading.Event()  # set: the client disconnects, so the server aborts the request
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.srv.url + "/generate", json=self.body, timeout=300) as r:
            self.rid, self.traceparent = r.headers["x-request-id"], r.headers.get("traceparent")
            for line in r.iter_lines():
                self.events += sse_events([line])
                if self.cut.is_set():
                    return


def counter(srv: ServerProc, name: str, **labels: str) -> float:
    return sum(s.value for s in samples(scrape(srv)) if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


def settled(read, quiet: float = 0.6, timeout: float = 10.0) -> float:
    """`read()` once it has not changed for `quiet` seconds: the Scheduler's counters reach /metrics with its
    stats, at most every heartbeat (0.2 s here), so one scrape can miss what the last step counted."""
    deadline, last, since = time.monotonic() + timeout, read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return last
    raise AssertionError(f"{read} still moving after {timeout} s (last {last})")


def entry(srv: ServerProc, rid: str, span: str) -> dict:
    """The rid's /debug/requests entry once the engine's `span` has arrived with the stats."""
    def got():
        r = httpx.get(f"{srv.url}/debug/requests/{rid}")
        return r.status_code == 200 and any(s["name"] == span for s in r.json()["spans"]) and r.json()
    return wait_until(got, 20, f"{rid}'s {span} span")


def generate(srv: ServerProc, ids: list[int], n: int) -> httpx.Response:
    return srv.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                         "ignore_eos": True}}, timeout=300)


def test_a_long_prefill_is_the_streams_gap_and_the_timeline_links_it(server):
    streams = [Stream(server, [5 + i, 6, 7, 8], 1200) for i in range(2)]  # still decoding when it comes
    wait_until(lambda: all(len(s.events) >= 20 for s in streams), 120, "two streams under way")
    before = settled(lambda: counter(server, "sightline_decode_gaps_total", cause="prefill"))
    r = generate(server, [3 + j % 900 for j in range(LONG_PROMPT)], 2)
    assert r.status_code == 200, r.text
    long_rid = r.headers["x-request-id"]
    for s in streams:
        s.join(300)
    gaps, every = [], []
    for s in streams:
        decode = next(x for x in entry(server, s.rid, "decode")["spans"] if x["name"] == "decode")
        every += [(e["attributes"]["sightline.decode_gap.cause"], e["attributes"]["sightline.decode_gap.seconds"])
                  for e in decode["events"] if e["name"] == "decode_gap"]
        gaps += [e for e in decode["events"] if e["name"] == "decode_gap"
                 and e["attributes"]["sightline.decode_gap.cause"] == "prefill"]
    by_long = [g for g in gaps if long_rid in g["attributes"]["sightline.decode_gap.culprit_rids"]]
    assert len(by_long) == 2, (gaps, every, r.json()["meta_info"])  # each stream's gap names the long prompt
    assert all(g["attributes"]["sightline.decode_gap.prefill_tokens"] >= LONG_PROMPT for g in by_long)
    SEEN.update(stream=streams[0].rid, long=long_rid)
    # The long prompt is the only prefill after `before` (both streams were decoding): the counter moves by
    # exactly its gaps.  A gap one stream's prefill made in the other (a slow machine can prefill them in
    # two steps) is in the span's events but was already counted in `before`.
    moved = lambda: counter(server, "sightline_decode_gaps_total", cause="prefill") - before  # noqa: E731
    wait_until(lambda: moved() >= len(by_long), 10, "the counter to count the long prompt's gaps")
    assert settled(moved) == len(by_long), (moved(), gaps, every)

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
        assert flow[0]["ph"] == "s" and flow[-1]["ph"] == "f" and len(flow) >= 20, flow[:3]
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
    assert any('data-source="gap"' in r and 'data-cause="prefill"' in r and f'data-rid="{SEEN["long"]}"' in r
               for r in rows)  # the gap's row links to the culprit's own page


def test_held_back_by_the_running_limit_and_a_pause(server):
    def reasons_count(reason):
        return counter(server, "sightline_request_wait_seconds_count", reason=reason)
    paused_before = reasons_count("paused")
    # the running limit, taken by streams long enough to outlast what follows on any machine (600 tokens
    # were over in about a second on a fast one, before the fourth request was seen waiting); they end when cut
    streams = [Stream(server, [9 + i, 6, 7], 2000) for i in range(3)]
    wait_until(lambda: all(len(s.events) >= 5 for s in streams), 120, "three streams under way")
    done: dict = {}
    waiter = threading.Thread(target=lambda: done.setdefault("r", generate(server, [4, 5, 6], 4)), daemon=True)
    waiter.start()
    wait_until(lambda: server.debug()["scheduler"]["num_waiting"] == 1, 30, "the fourth request waiting")
    assert server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    wait_until(lambda: server.debug()["scheduler"]["paused"], 10, "the pause in effect")
    assert server.post("/continue_generation", {}).status_code == 200
    assert all(not s.cut.is_set() and s.is_alive() for s in streams)  # still the running limit after the pause
    streams[0].cut.set()  # its disconnect frees a slot: the fourth request runs
    waiter.join(300)
    for s in streams:
        s.cut.set()
        s.join(300)
    breakdown = done["r"].json()["meta_info"]["sightline"]
    waits = breakdown["wait_ms"]
    assert waits.get("running_limit", 0) > 0 and waits.get("paused", 0) > 0, waits
    assert abs(sum(waits.values()) - breakdown["queue_ms"]) < 0.01 * len(waits), breakdown
    wait_until(lambda: reasons_count("paused") == paused_before + 1, 10, "one paused wait observed")
    # the caller sees the same numbers in Server-Timing; the server span carries them as vLLM names them
    timing = dict(part.split(";dur=") for part in done["r"].headers["server-timing"].split(", "))
    assert set(timing) == {"queue", "prefill", "decode", "tokenize", "total"}, timing
    assert abs(float(timing["queue"]) - breakdown["queue_ms"]) < 0.002 and float(timing["total"]) > 0
    rid = done["r"].headers["x-request-id"]
    (root,) = [x for x in entry(server, rid, "queue")["spans"] if x["kind"] == "SERVER"]
    attrs = root["attributes"]
    assert abs(attrs["gen_ai.latency.time_in_queue"] * 1e3 - breakdown["queue_ms"]) < 0.002
    assert {"gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e", "gen_ai.latency.time_in_model_prefill",
            "gen_ai.latency.time_in_model_decode", "gen_ai.latency.time_in_model_inference"} <= set(attrs)
    assert attrs["sightline.wait.paused_seconds"] > 0
