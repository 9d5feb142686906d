"""Why it waited for the step budget, and the decode gaps made after the Scheduler, on one real tiny-random
server: a prompt behind a long chunked prefill waits for the step budget; a stopped Detokenizer (SIGSTOP) is
each stream's `detokenizer` gap, a stopped main process (its event loop) each stream's `main_loop` gap, and
an engine restart (SIGKILL of the Scheduler) each cut stream's `engine_restart` gap — on the request's server
span and in sightline_decode_gaps_total, moved by exactly one per stream (and, after a stopped Detokenizer, by
the `main_loop` gaps the streams' spans show if the TokenizerManager lagged reading its backlog).  The gap
floor (0.3 s) is far above this machine's noise and far below the 1 s stops.
The streams are held one token short of their end (tests.server_util.HOLD), so they are running whenever a
stop or a kill comes, and a step floor of STEP_MS keeps their tokens coming at a bounded pace meanwhile."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_debug_ui import Rows, chromium, headless
from tests.e2e.test_why_slow import Stream, counter, entry, generate, scheduler_stopped, sent_on
from tests.server_util import ServerProc, wait_until

STOP_S = 1.0
SEEN: dict[str, str] = {}  # a stream with a detokenizer gap, for the inspector's test
STEP_MS = 20  # the step floor: at most 50 tokens a second per stream
TOKENS = 64  # per stream: it streams 63 (over a second at the floor's pace), then is held until released


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(
        "--max-prefill-tokens",
        "32",
        "--max-step-tokens",
        "32",
        "--min-prefill-chunk",
        "32",
        "--decode-gap-factor",
        "4",
        "--decode-gap-floor",
        "0.3",
        "--heartbeat-interval",
        "0.2",
        tmpdir=tmp_path_factory.mktemp("why-down"),
        step_floor_ms=STEP_MS,
    )
    yield srv
    srv.stop()


def gaps(srv: ServerProc, cause: str) -> float:
    return counter(srv, "sightline_decode_gaps_total", cause=cause)


def server_span_gaps(srv: ServerProc, rid: str, every: list | None = None) -> list[dict]:
    """The decode_gap events of the rid's server span (the TokenizerManager's), once its record is in."""

    def root():
        r = httpx.get(f"{srv.url}/debug/requests/{rid}")
        return r.status_code == 200 and [s for s in r.json()["spans"] if s["kind"] == "SERVER"]

    (span,) = wait_until(root, 20, f"{rid}'s server span")
    if every is not None:
        every.append((span["attributes"], [e["name"] for e in span["events"]]))
    return [e["attributes"] for e in span["events"] if e["name"] == "decode_gap"]


def test_a_prompt_behind_a_long_chunked_prefill_waits_for_the_step_budget(server):
    """Both reach a stopped Scheduler, the long one first: once it runs on, its first step spends the whole budget
    on the long prompt's first chunk, and the short one waits for the step budget for 44 steps."""
    done: dict = {}
    with scheduler_stopped(server):
        for n, (name, ids) in enumerate((("long", [5 + j for j in range(1400)]), ("short", [3, 4, 5])), 1):
            threading.Thread(
                target=lambda n=name, i=ids: done.setdefault(n, generate(server, i, 2)), daemon=True
            ).start()
            sent_on(server, n)  # on its socket, in this order
    wait_until(lambda: len(done) == 2, 120, "both answered")
    b = entry(server, done["short"].headers["x-request-id"], "decode")
    assert b["wait_ms"].get("step_budget", 0) > 0, b
    assert abs(sum(b["wait_ms"].values()) - b["queue_ms"]) < 0.01 * len(b["wait_ms"]), b


def stopped(srv: ServerProc, pid: int, cause: str) -> None:
    srv.barrier()
    before = {c: gaps(srv, c) for c in ("detokenizer", "main_loop", "engine_restart")}
    streams = [Stream(srv, [11 + i, 6, 7, 8], TOKENS, hold=True) for i in range(2)]
    wait_until(lambda: all(s.tokens() >= 3 for s in streams), 60, "two streams under way")
    assert srv.held() == 0  # both still decoding (at the floor's pace, for most of a second more)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(STOP_S)  # clock: the stop, longer than the gap floor
    os.kill(pid, signal.SIGCONT)
    srv.wait_held(2)
    srv.release()
    for s in streams:
        s.join(60)
    assert all(s.events[-1] == "[DONE]" and s.tokens() == TOKENS for s in streams)
    causes: dict[str, int] = {}
    for s in streams:  # the stream's server span names the cause of its long gap: the stop, first
        every: list = []
        found = server_span_gaps(srv, s.rid, every)
        assert found and found[0]["sightline.decode_gap.cause"] == cause, (found, every)
        assert found[0]["sightline.decode_gap.seconds"] > STOP_S * 0.8
        for g in found:  # then, at most, the TokenizerManager's loop catching up with the backlog
            assert g["sightline.decode_gap.cause"] in (cause, "main_loop"), found
            causes[g["sightline.decode_gap.cause"]] = causes.get(g["sightline.decode_gap.cause"], 0) + 1
    assert causes[cause] == 2, causes  # one per stream
    SEEN[cause] = streams[0].rid
    srv.barrier()
    assert {c: gaps(srv, c) for c in before} == {c: before[c] + causes.get(c, 0) for c in before}, causes


def test_a_stopped_detokenizer_is_each_streams_detokenizer_gap(server):
    stopped(server, server.debug()["pids"]["detokenizer"], "detokenizer")


def test_the_inspector_marks_the_detokenizer_gap_in_the_main_lane(server, tmp_path):
    browser = chromium()
    if "detokenizer" not in SEEN:
        pytest.skip("needs the gap of test_a_stopped_detokenizer_is_each_streams_detokenizer_gap")
    parsed = Rows()
    parsed.feed(headless(browser, tmp_path, f"{server.url}/debug/ui#rid={SEEN['detokenizer']}", "--dump-dom"))
    gaps = [r for r in parsed.rows if r.get("data-source") == "gap"]
    assert any(r["data-cause"] == "detokenizer" and r["data-lane"] == "main" for r in gaps), gaps


def test_a_stopped_main_process_is_each_streams_main_loop_gap(server):
    stopped(server, server.proc.pid, "main_loop")


def test_an_engine_restart_is_each_cut_streams_engine_restart_gap(server):
    streams = [Stream(server, [21 + i, 6, 7, 8], TOKENS, hold=True) for i in range(2)]
    server.wait_held(2)  # both running when the Scheduler dies
    before = gaps(server, "engine_restart")
    os.kill(server.debug()["pids"]["scheduler"], signal.SIGKILL)
    for s in streams:
        s.join(60)
    assert all("error" in s.events[-2] for s in streams), [s.events[-2:] for s in streams]
    for s in streams:
        found = server_span_gaps(server, s.rid)
        assert [g["sightline.decode_gap.cause"] for g in found] == ["engine_restart"], found
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, 60, "the engine restarted")
    assert gaps(server, "engine_restart") - before == 2  # counted where the streams were cut: the front end
