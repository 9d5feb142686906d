"""The test seams every other e2e test leans on, on a real server: a held request stops one token short
and stays running (its KV kept, the stall check quiet) until released or cut; the pipeline barrier
returns behind every output and stats message; the step floor spaces tokens however fast the engine."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server_util import HOLD, ServerProc, Stream, scrape, value, wait_until


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProc("--stall-timeout", "1", tmpdir=tmp_path_factory.mktemp("seams"), step_floor_ms=20)
    yield s
    s.stop()


def test_a_held_request_stops_one_token_short_until_released(srv):
    s = Stream(srv, "hold me", {"max_new_tokens": 8, "temperature": 0, **HOLD})
    srv.wait_held(1)
    wait_until(lambda: len(s.tokens()) == 7, 10, "every token but the last at the client")
    assert "[DONE]" not in s.events
    state = srv.debug()["scheduler"]
    assert state["num_running"] == 1 and state["held"] == 1 and state["kv_in_use"] > 0  # running, its KV kept
    time.sleep(1.5)  # clock: past the 1 s --stall-timeout: a held request is not a stuck engine
    assert httpx.get(srv.url + "/health").status_code == 200
    srv.release()
    s.join(30)
    assert len(s.tokens()) == 8 and s.events[-1] == "[DONE]"
    assert srv.held() == 0 and srv.debug()["scheduler"]["num_running"] == 0


def test_a_held_request_is_cut_by_its_client_and_frees_its_slot(srv):
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        timeout=30,
        json={"prompt": "cut me", "max_tokens": 6, "stream": True, **HOLD},
    ) as r:
        assert r.status_code == 200
        srv.wait_held(1)
    srv.barrier()
    assert srv.held() == 0
    state = srv.debug()["scheduler"]
    assert state["num_running"] == 0 and state["kv_in_use"] == 0


def test_release_names_its_requests(srv):
    a = Stream(srv, "first", {"max_new_tokens": 4, "temperature": 0, **HOLD})
    b = Stream(srv, "second", {"max_new_tokens": 4, "temperature": 0, **HOLD})
    srv.wait_held(2)
    rids = [e["meta_info"]["id"] for e in a.events if isinstance(e, dict)]
    srv.release(rids[0])
    a.join(30)
    assert a.events[-1] == "[DONE]" and srv.held() == 1 and "[DONE]" not in b.events
    srv.release()
    b.join(30)
    assert b.events[-1] == "[DONE]"


def test_unmarked_requests_are_never_held(srv):
    r = srv.post("/v1/completions", {"prompt": "free", "max_tokens": 5, "ignore_eos": True, "seed": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_the_barrier_is_behind_every_output_and_stats_message(srv):
    before = value(scrape(srv), "sightline_generation_tokens_total")
    for i in range(3):
        srv.post("/v1/completions", {"prompt": f"count {i}", "max_tokens": 3, "ignore_eos": True})
    srv.barrier()  # no waiting for a heartbeat: the engine's stats are in
    assert value(scrape(srv), "sightline_generation_tokens_total") == before + 9
    assert srv.debug()["scheduler"]["generation_tokens_total"] >= 9


def test_the_step_floor_spaces_tokens(srv):
    s = Stream(srv, "floor", {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    s.join(30)
    gaps = [b - a for a, b in zip(s.times, s.times[1:-1])]  # token to token (the last event is [DONE])
    # 20 ms a step: their mean, less the delivery jitter between processes (one token that reaches the client
    # late shortens the gap after it by as much, so no single gap is bounded; the sum of eight is)
    assert len(gaps) >= 8 and sum(gaps[1:]) / len(gaps[1:]) >= 0.015
