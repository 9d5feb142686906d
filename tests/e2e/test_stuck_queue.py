"""The stuck-queue detector on a real server, in the shape of vllm#53130: the engine admits nothing (the
admission-stop seam, armed by a running request) while that request goes on producing tokens, so the token-based
stall check stays quiet; the queue head's age and `fits` expose it, /health degrades naming the rank, and the
queue moves again once the fault is gone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving.engine.seams import STOP_ADMISSION_ENV
from tests.server_util import HOLD, HOLD_SEED, ServerProc, Stream, scrape, value, wait_until

BOUND = 1.0  # --queue-stuck-timeout


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # the held request carries the admission-stop seed: it runs (tokens flow until it is held) and blocks admission
    s = ServerProc(
        "--queue-stuck-timeout",
        str(BOUND),
        "--stall-timeout",
        "1",
        env={STOP_ADMISSION_ENV: str(HOLD_SEED)},
        tmpdir=tmp_path_factory.mktemp("stuck_queue"),
        step_floor_ms=20,
    )
    yield s
    s.stop()


def health(srv: ServerProc) -> httpx.Response:
    return httpx.get(srv.url + "/health", timeout=10)


def test_a_queue_that_admits_nothing_while_tokens_flow_degrades_health_until_it_moves(srv):
    blocker = Stream(srv, "block the queue", {"max_new_tokens": 24, "temperature": 0, **HOLD})
    wait_until(lambda: blocker.tokens(), 30, "the blocking request's first token")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            srv.post,
            "/v1/completions",
            {"prompt": "Let me in", "max_tokens": 2, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        wait_until(lambda: srv.debug()["scheduler"]["num_waiting"] == 1, 30, "the second request queued")
        r = wait_until(lambda: (h := health(srv)).status_code == 503 and h, 30, "/health degraded")
        assert r.json() == {"status": "unavailable", "reason": r.json()["reason"]}
        assert r.json()["reason"].startswith("queue stuck on rank 0: its oldest request has waited ")
        text = scrape(srv)
        assert value(text, "sightline_queue_head_age_seconds", dp_rank="0") > BOUND
        assert value(text, "sightline_queue_head_fits", dp_rank="0") == 1  # KV and batch room: not saturation
        assert value(text, "sightline_scheduler_admissions_total", dp_rank="0") == 1  # the blocker alone
        assert value(text, "sightline_scheduler_generated_tokens_total") >= len(blocker.tokens()) > 0
        assert value(text, "sightline_seconds_since_last_token") == 0  # the token check sees nothing wrong
        assert not waiting.done()
        srv.release()  # the blocker ends: admission resumes
        blocker.join(30)
        done = waiting.result(60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    assert len(blocker.tokens()) == 24 and blocker.events[-1] == "[DONE]"
    wait_until(lambda: health(srv).status_code == 200, 10, "/health ok again")
    text = scrape(srv)
    assert value(text, "sightline_scheduler_admissions_total", dp_rank="0") == 2
    assert value(text, "sightline_queue_head_age_seconds", dp_rank="0") == 0
