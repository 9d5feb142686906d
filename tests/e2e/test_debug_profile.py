"""POST /debug/profile: py-spy on a live Scheduler while it generates; one at a time; bounded; behind the key."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_util import TEST_KEY

KEY = TEST_KEY
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture
def server(keyed_server):
    return keyed_server


def profile(server, timeout: float = 60, headers=AUTH, **params) -> httpx.Response:
    return httpx.post(server.url + "/debug/profile", params=params, headers=headers, timeout=timeout)


def test_profile_of_the_scheduler_while_it_generates_and_one_at_a_time(server):
    stop = threading.Event()

    def generate() -> None:  # keep the engine busy for the whole profile
        while not stop.is_set():
            r = server.post(
                "/v1/completions",
                {"model": "tiny-random", "prompt": "hello " * 20, "max_tokens": 64, "ignore_eos": True},
                headers=AUTH,
            )
            assert r.status_code == 200, r.text

    load = threading.Thread(target=generate, daemon=True)
    load.start()
    try:
        with ThreadPoolExecutor(2) as pool:  # the second arrives while the first records: 409 for one of them
            first = pool.submit(profile, server, process="scheduler", seconds=2)
            threading.Event().wait(0.7)
            second = pool.submit(profile, server, process="scheduler", seconds=2)
            answers = [first.result(), second.result()]
    finally:
        stop.set()
        load.join(60)
    assert sorted(r.status_code for r in answers) == [200, 409], [r.text[:300] for r in answers]
    busy = next(r for r in answers if r.status_code == 409).json()["error"]
    assert busy["code"] == "profile_in_progress" and busy["type"] == "invalid_request_error"
    ok = next(r for r in answers if r.status_code == 200)
    assert ok.headers["content-type"].startswith("application/json")
    doc = json.loads(ok.content)
    assert doc["$schema"].startswith("https://www.speedscope.app/")
    files = {f.get("file", "") for f in doc["shared"]["frames"]}
    assert any("serving/engine/" in f for f in files), sorted(files)[:40]
    assert sum(len(p["samples"]) for p in doc["profiles"]) > 0
    # the lock went with the request: the next profile (of another process, as flamegraph SVG) runs
    svg = profile(server, process="detokenizer", seconds=1, format="flamegraph", idle=1)
    assert svg.status_code == 200, svg.text
    assert svg.headers["content-type"].startswith("image/svg+xml") and b"<svg" in svg.content[:2000]
    assert "sandbox" in svg.headers["content-security-policy"]


@pytest.mark.parametrize(
    "params",
    [
        {"process": "scheduler", "seconds": "0"},
        {"process": "scheduler", "seconds": "61"},
        {"process": "scheduler", "seconds": "2.5"},
        {"process": "nope", "seconds": "1"},
        {"seconds": "1"},
        {"process": "scheduler_dp1", "seconds": "1"},
        {"process": "main", "seconds": "1", "format": "png"},
        {"process": "main", "seconds": "1", "rate": "0"},
    ],
)
def test_bad_arguments_are_400(server, params):
    r = profile(server, timeout=10, **params)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] in ("process", "seconds", "format", "rate")


def test_needs_the_key_and_a_post(server):
    r = profile(server, timeout=10, headers={}, process="scheduler", seconds=1)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/debug/profile", headers=AUTH, timeout=10).status_code == 405
