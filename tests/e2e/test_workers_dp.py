"""Two tokenizer workers × two Scheduler ranks, for real: a hub, 2 HTTP workers on one port,
2 engine ranks and the Detokenizer, over real ZMQ and HTTP.

Under 200 concurrent mixed requests every answer is complete and right, and one scrape of
/metrics (whichever worker answers it) counts exactly what the client saw, with exemplars;
a worker killed with -9 ends only its own streams, is replaced, and leaves nothing behind.
The streams a pause or a kill must find running are held (tests.server_util.HOLD) until then.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.server_util import (
    HOLD,
    ServerProc,
    Stream,
    chat_text,
    completion_text,
    samples,
    scrape,
    sse_events,
    value,
    wait_until,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The quick brown fox",
    "In 1969, astronauts",
    "Water boils at",
    "My favourite colour is",
    "To be or not to be",
]


FAULT_SEED = 4242
HELD = 16  # max_tokens of a held stream: it sends 15 tokens, then stays running until released or cut


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, otlp):
    srv = ServerProc(
        "--tokenizer-worker-num",
        "2",
        "--dp-size",
        "2",
        "--max-queued-requests",
        "512",
        "--otel-exporter-otlp-endpoint",
        otlp.endpoint,
        "--tail-sampling-overrides-parent",
        "--otel-metrics-exporter",
        "otlp",
        "--otel-metrics-catalogue",
        "--otel-metric-export-interval",
        "2000",
        tmpdir=tmp_path_factory.mktemp("workers-dp"),
        env={"SIGHTLINE_FAULT_SEED": str(FAULT_SEED), "OTEL_BSP_SCHEDULE_DELAY": "200"},
    )
    yield srv
    srv.stop()


def _body(kind: str, i: int, stream: bool) -> tuple[str, dict]:
    prompt = f"{PROMPTS[i % len(PROMPTS)]} (case {i})"
    common = {"max_tokens": 12, "temperature": 0, "stream": stream}
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    return "/v1/completions", {"prompt": prompt, **common}


async def _one(client: httpx.AsyncClient, kind: str, i: int, stream: bool) -> tuple[str, int, int, str]:
    """(text, prompt_tokens, completion_tokens, finish_reason) of one request."""
    path, body = _body(kind, i, stream)
    if not stream:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        d = r.json()
        choice = d["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return text, d["usage"]["prompt_tokens"], d["usage"]["completion_tokens"], choice["finish_reason"]
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = sse_events([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]", events[-3:]
    usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
    finish = next(
        e["choices"][0]["finish_reason"]
        for e in events
        if isinstance(e, dict) and e["choices"] and e["choices"][0].get("finish_reason")
    )
    text = chat_text(events) if kind == "chat" else completion_text(events)
    return text, usage["prompt_tokens"], usage["completion_tokens"], finish


def test_200_concurrent_mixed_requests_are_complete_right_and_counted_exactly(fleet):
    before = scrape(fleet)
    cases = [(kind, i, stream) for i in range(50) for kind in ("chat", "completion") for stream in (True, False)]

    async def main():
        async with httpx.AsyncClient(
            base_url=fleet.url, timeout=180, limits=httpx.Limits(max_connections=200)
        ) as client:
            return await asyncio.gather(*(_one(client, *c) for c in cases))

    results = dict(zip(cases, asyncio.run(main())))
    for kind, i, _ in cases[::2]:  # greedy: the streamed text is the non-streamed text
        streamed, whole = results[(kind, i, True)], results[(kind, i, False)]
        assert streamed == whole and whole[2] == 12 and whole[3] == "length", (kind, i, streamed, whole)
    # one scrape, whichever worker answers, counts exactly what the client saw
    after = scrape(fleet)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sightline_requests_total", finish_reason="length", status="200") == 200
    assert delta("sightline_generation_tokens_total") == sum(r[2] for r in results.values()) == 200 * 12
    assert delta("sightline_prompt_tokens_total") == sum(r[1] for r in results.values())
    assert delta("sightline_time_to_first_token_seconds_count") == 200
    assert delta("sightline_http_requests_total", route="/v1/chat/completions", status="200") == 100
    # both ranks computed, both workers served (each has its own in-flight gauge)
    assert delta("sightline_scheduler_generated_tokens_total", dp_rank="0") > 0
    assert delta("sightline_scheduler_generated_tokens_total", dp_rank="1") > 0
    assert {"1", "2"} <= {
        s.split('worker="')[1].split('"')[0]
        for s in after.splitlines()
        if s.startswith("sightline_requests_in_flight{")
    }
    # no series twice: the text parses as one family each (the parser would raise on a duplicate TYPE)
    assert after.count("# TYPE sightline_requests_total counter") == 1
    om = scrape(fleet, openmetrics=True)
    exemplars = [
        line
        for line in om.splitlines()
        if line.startswith("sightline_time_to_first_token_seconds_bucket") and "trace_id=" in line
    ]
    assert exemplars, "the merged OpenMetrics exposition lost the exemplars"


def test_the_catalogue_over_otlp_from_each_worker_and_the_hub(fleet, otlp):
    """--otel-metrics-catalogue: each worker pushes its own registry (the requests it served, TTFT as an
    exponential histogram), the hub the engine's numbers (every rank's); over the workers the requests
    add up to the merged /metrics."""

    def pushed():
        total = value(scrape(fleet), "sightline_requests_total")
        by_worker: dict = {}
        for p in otlp.latest_points("sightline_requests"):
            worker = p["resource"].get("sightline.worker")
            by_worker[worker] = by_worker.get(worker, 0) + p["value"]
        return by_worker if set(by_worker) == {1, 2} and sum(by_worker.values()) == total > 0 else None

    wait_until(pushed, 20, "every worker's requests pushed")
    ttft = otlp.latest_points("sightline_time_to_first_token_seconds")
    assert {p["resource"]["sightline.worker"] for p in ttft} == {1, 2}
    assert all(p["kind"] == "exponential_histogram" and p["resource"]["sightline.process.role"] == "main" for p in ttft)
    phases = otlp.latest_points("sightline_engine_step_phase_seconds")
    assert phases and {p["resource"]["sightline.process.role"] for p in phases} == {"hub"}
    assert {p["attributes"]["dp_rank"] for p in phases} == {"0", "1"} and all(p["kind"] == "histogram" for p in phases)


def test_any_worker_finds_any_rid_with_one_trace_across_processes(fleet):
    rids = [
        fleet.post("/generate", {"text": f"{p} again", "sampling_params": {"max_new_tokens": 4}}).json()["meta_info"][
            "id"
        ]
        for p in PROMPTS
    ]
    workers, ranks = set(), set()
    for rid in rids:  # each lookup lands on some worker; the hub asks them all

        def entry():
            r = httpx.get(f"{fleet.url}/debug/requests/{rid}", timeout=10)
            e = r.json() if r.status_code == 200 else None
            return e if e and {"main", "scheduler", "detokenizer"} <= {s["role"] for s in e["spans"]} else None

        e = wait_until(entry, 10, f"the spans of {rid} from every process")
        assert {s["trace_id"] for s in e["spans"]} == {e["trace_id"]}
        workers |= {s["attributes"]["sightline.worker"] for s in e["spans"] if s["role"] == "main"}
        ranks |= {s["attributes"]["sightline.dp_rank"] for s in e["spans"] if s["role"] == "scheduler"}
    assert workers == {1, 2} and ranks <= {0, 1}
    r = httpx.get(f"{fleet.url}/debug/requests/no-such-rid", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "rid"


def test_tail_sampling_exports_a_failed_requests_trace_from_its_worker_and_the_hub(fleet, otlp):
    """Callers' sampled=0 with --tail-sampling-overrides-parent: recorded, decided at the end. The
    worker decides and exports its own spans; the hub exports the engine's."""
    failed, fine = "5e" * 16, "5f" * 16
    r = fleet.post(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "seed": FAULT_SEED},
        headers={"traceparent": f"00-{failed}-{'ab' * 8}-00"},
    )
    assert r.status_code == 500 and r.headers["traceparent"].split("-")[1] == failed
    ok = fleet.post(
        "/v1/completions", {"prompt": "x", "max_tokens": 4}, headers={"traceparent": f"00-{fine}-{'ab' * 8}-00"}
    )
    assert ok.status_code == 200 and "trace_id" not in ok.json()["sightline"]

    def origins():
        got = {
            (s["resource"]["sightline.process.role"], s["resource"].get("sightline.worker")) for s in otlp.trace(failed)
        }
        return got if {"main", "scheduler", "detokenizer"} <= {role for role, _ in got} else None

    got = wait_until(origins, 20, "the failed request's trace from its worker and the engine")
    assert {w for role, w in got if role == "main"} <= {1, 2} and None not in {w for role, w in got if role == "main"}
    server = next(s for s in otlp.trace(failed) if s["kind"] == "SERVER")
    assert server["attributes"]["sightline.tail_sampling.reason"] == "error" and server["parent_span_id"] == "ab" * 8
    assert otlp.trace(fine) == []


def test_flush_cache_reaches_every_rank(fleet):
    r = fleet.post("/flush_cache", {})
    assert r.status_code == 200, r.text
    state = fleet.debug()
    assert [s["prefix_cached_tokens"] for s in state["schedulers"]] == [0, 0]


def _every_worker(fleet, n: int = 8) -> list[httpx.Response]:
    """/health on n new connections: the kernel spreads them over the workers."""
    return [httpx.get(fleet.url + "/health", headers={"connection": "close"}) for _ in range(n)]


def test_control_actions_reach_every_worker_and_rank(fleet):
    held = {"max_new_tokens": HELD, "temperature": 0, **HOLD}
    r = fleet.post("/control/log_level", {"level": "debug"})
    assert r.status_code == 200, r.text
    assert (
        r.json()["processes"]
        == ["hub", *(f"worker-{w}" for w in r.json()["workers"]), "scheduler_dp0", "scheduler_dp1"]
        and len(r.json()["workers"]) == 2
    )
    assert fleet.post("/control/log_level", {"level": "info"}).json()["previous"] == "debug"
    r = fleet.post("/control/tracing", {"sampling_ratio": 0.25})
    assert r.status_code == 200 and fleet.post("/control/tracing", {"sampling_ratio": 1.0}).json()["previous"] == 0.25
    bad = fleet.post("/pause_generation", {"mode": "sideways"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"

    streams = [Stream(fleet, f"hold me {i}", held) for i in range(6)]  # one connection each: both workers
    try:
        fleet.wait_held(6)
        r = fleet.post("/pause_generation", {"mode": "in_place"})
        assert r.status_code == 200 and len(r.json()["workers"]) == 2 and r.json()["in_flight"] == 6, r.text
        state = fleet.debug()
        assert all(s["paused"] for s in state["schedulers"]), state["schedulers"]
        wait_until(lambda: all(len(s.tokens()) == HELD - 1 for s in streams), 10, "the held tokens at the clients")
        rids = [next(e["meta_info"]["id"] for e in s.events if isinstance(e, dict)) for s in streams]
        generated = [s["generation_tokens_total"] for s in fleet.debug()["schedulers"]]
        released, kept = streams[:3], streams[3:]
        fleet.release(*rids[:3], dp_size=2)  # free to step again, but paused: no rank may step them
        assert all(h.status_code == 503 and h.json()["reason"] == "paused" for h in _every_worker(fleet))
        refused = fleet.post("/v1/completions", {"prompt": "no", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "paused", refused.text
        fleet.wait_held(3)  # the release is handled on both ranks ...
        fleet.barrier()  # ... and the output of any step after it has reached the front end
        assert [s["generation_tokens_total"] for s in fleet.debug()["schedulers"]] == generated, "a paused rank stepped"
        assert all(len(s.tokens()) == HELD - 1 and s.is_alive() for s in streams), "tokens arrived while paused"
        # what an inference router reads: one series per server over both ranks
        series = [s for s in samples(scrape(fleet)) if s.name.startswith("sightline_server_")]
        assert {s.name: s.value for s in series}["sightline_server_num_requests_running"] == 6, series
        assert len(series) == 3 and 0 < {s.name: s.value for s in series}["sightline_server_kv_cache_usage_perc"] < 1
        r = fleet.post("/continue_generation", {})
        assert r.status_code == 200 and r.json()["resumed"] == "in_place", r.text
        for s in released:  # they go on, to their end
            s.join(30)
            *_, last, done = s.events
            assert done == "[DONE]" and last["meta_info"]["finish_reason"]["type"] == "length", s.events[-3:]
            assert len(s.tokens()) == HELD
        assert fleet.held() == 3 and all(s.is_alive() for s in kept)
        r = fleet.post("/pause_generation", {"mode": "abort"})  # every stream still running ends, explicitly
        assert r.status_code == 200 and r.json()["aborted"] == 3 and r.json()["in_flight"] == 0, r.text
        for s in kept:
            s.join(30)
            *_, last, done = s.events
            assert done == "[DONE]" and "aborted by an operator" in last["error"]["message"], s.events[-3:]
            assert len(s.tokens()) == HELD - 1
    finally:
        assert fleet.post("/continue_generation", {}).status_code == 200
    assert all(h.status_code == 200 for h in _every_worker(fleet))
    text = scrape(fleet)
    assert value(text, "sightline_control_actions_total", action="pause_in_place", result="ok") == 1
    assert value(text, "sightline_control_actions_total", action="pause", result="rejected") == 0  # not counted
    assert value(text, "sightline_paused", mode="abort") == 0
    # idle again: the prefix cache keeps the prompts, but none is locked, so no KV counts as used
    fleet.barrier()  # the aborts have reached both ranks, their stats are in
    assert value(scrape(fleet), "sightline_server_kv_cache_usage_perc") == 0


def test_a_rank_that_does_not_confirm_is_named(fleet):
    """A stopped rank cannot confirm a pause in place: the answer names it; once it runs again
    the pause takes effect and the resume is confirmed by every rank."""
    rank1 = fleet.debug()["pids"]["scheduler_dp1"]
    os.kill(rank1, signal.SIGSTOP)
    try:
        r = fleet.post("/pause_generation", {"mode": "in_place"})
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "control_unconfirmed", r.text
        assert "scheduler_dp1" in err["message"] and "scheduler_dp0" not in err["message"], err
    finally:
        os.kill(rank1, signal.SIGCONT)
    fleet.barrier()  # rank 1 runs again: it has handled the pause before the barrier, its stats are in
    assert all(s["paused"] for s in fleet.debug()["schedulers"]), fleet.debug()["schedulers"]
    r = fleet.post("/continue_generation", {})
    assert r.status_code == 200 and r.json()["resumed"] == "in_place", r.text
    assert fleet.post("/v1/completions", {"prompt": "after", "max_tokens": 2}).status_code == 200


def test_the_step_timeline_merges_every_rank_whichever_worker_answers(fleet):
    """Each answer comes from whichever worker accepted the connection; the replies of both ranks reach it."""

    async def load():  # concurrent: the rank picker spreads them over both ranks
        async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
            rs = await asyncio.gather(
                *[client.post("/v1/completions", json={"prompt": f"timeline {i}", "max_tokens": 32}) for i in range(8)]
            )
        assert all(r.status_code == 200 for r in rs)

    asyncio.run(load())
    for _ in range(4):
        events = httpx.get(fleet.url + "/debug/timeline?seconds=600", timeout=30).json()["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
        assert names == {0: "scheduler dp0", 1: "scheduler dp1"}
        steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
        assert {e["pid"] for e in steps} == {0, 1}, "both ranks' steps"


def _held_on_both_workers(fleet, n: int) -> dict:
    """/debug/state once `n` streams are held and the hub sees them in flight, on both workers."""
    fleet.wait_held(n)

    def state():  # each worker reports its in-flight count to the hub on its own schedule
        st = httpx.get(f"{fleet.url}/debug/state", timeout=10).json()  # not through the streams' pool
        return st if st["in_flight"] == n and all(w["in_flight"] for w in st["workers"].values()) else None

    return wait_until(state, 10, f"the {n} streams in flight on both workers")


def test_kill_9_one_worker_ends_only_its_streams_and_leaves_nothing_behind(fleet):
    """Runs near the end of this module: it replaces one of the fixture's workers."""
    done: dict[int, tuple[str, float, int]] = {}
    killed_at: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "prompt": f"count {i}",
            "max_tokens": HELD,
            "temperature": 0,
            **HOLD,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        n = 0
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"usage": {' in line or '"usage":{' in line:
                        n = sse_events([line])[0]["usage"]["completion_tokens"]
                    if line == "data: [DONE]":
                        done[i] = ("done", time.monotonic(), n)
                        return
            done[i] = ("closed", time.monotonic(), n)
        except httpx.HTTPError:
            done[i] = ("error", time.monotonic(), n)

    async def main():
        async with httpx.AsyncClient(
            base_url=fleet.url, timeout=120, limits=httpx.Limits(max_connections=20, max_keepalive_connections=0)
        ) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(20)]
            st = await asyncio.to_thread(_held_on_both_workers, fleet, 20)
            victim = next(iter(st["workers"].values()))
            killed_at.append(time.monotonic())
            os.kill(victim["pid"], signal.SIGKILL)
            # the victim's streams end at once and the engine drops them; the other worker's stay held
            await asyncio.to_thread(wait_until, lambda: len(done) == victim["in_flight"], 10, "the victim's streams")
            await asyncio.to_thread(fleet.wait_held, 20 - victim["in_flight"])
            fleet.release(dp_size=2)
            await asyncio.gather(*tasks)
            return st, victim

    st, victim = asyncio.run(main())
    ended = [d for d in done.values() if d[0] != "done"]
    finished = [d for d in done.values() if d[0] == "done"]
    assert len(ended) == victim["in_flight"] and len(finished) == 20 - victim["in_flight"], (done, st["workers"])
    # at once, give or take this client's own loop (the other worker's streams keep it busy)
    assert all(t - killed_at[0] < 5.0 for _, t, _ in ended), [t - killed_at[0] for _, t, _ in ended]
    assert all(n == HELD for _, _, n in finished)  # nothing lost on the other worker

    def settled():
        s = fleet.debug()
        ups = [w for w in s["workers"].values() if w["up"]]
        return (
            s
            if (
                len(ups) == 2
                and str(victim["pid"]) not in {str(w["pid"]) for w in ups}
                and s["in_flight"] == 0
                and s["scheduler"]["num_running"] == 0
                and s["detokenizer"]["active_rids"] == 0
                and s["scheduler"]["kv_used"] == s["scheduler"]["prefix_cached_tokens"]
            )
            else None
        )

    s = wait_until(settled, 15, "a replacement worker, and no request, KV or decode state left")
    assert s["scheduler"]["kv_reserved"] == 0
    text = scrape(fleet)
    assert value(text, "sightline_worker_failures_total", cause="exited") == 1
    assert value(text, "sightline_tokenizer_workers") == 2
    # the survivors and the newcomer serve on
    assert fleet.post("/v1/completions", {"prompt": "still there?", "max_tokens": 3}).status_code == 200


def test_an_engine_rank_that_dies_fails_every_workers_requests_explicitly_then_serves_again(fleet):
    """A Scheduler rank killed: both ranks and the Detokenizer are replaced (their per-rid state only makes
    sense together) and every worker ends its in-flight streams with the error event."""

    async def one(client: httpx.AsyncClient, i: int) -> list:
        body = {"prompt": f"long {i}", "max_tokens": HELD, **HOLD, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            return sse_events([line async for line in r.aiter_lines()])

    async def main():
        async with httpx.AsyncClient(
            base_url=fleet.url, timeout=120, limits=httpx.Limits(max_connections=12, max_keepalive_connections=0)
        ) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(12)]
            st = await asyncio.to_thread(_held_on_both_workers, fleet, 12)
            os.kill(st["pids"]["scheduler_dp1"], signal.SIGKILL)
            return await asyncio.gather(*tasks), st

    results, st = asyncio.run(main())
    for events in results:
        assert events[-1] == "[DONE]" and "engine failed" in events[-2]["error"]["message"], events[-3:]
    fleet.wait_healthy(120)  # both ranks and the Detokenizer restart: as long as a start on a busy machine
    assert value(scrape(fleet), "sightline_engine_failures_total", role="scheduler_dp1", cause="exited") == 1
    assert fleet.post("/v1/completions", {"prompt": "back?", "max_tokens": 3}).status_code == 200
