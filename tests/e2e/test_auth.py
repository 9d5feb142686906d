"""API key: 401 with an OpenAI error body unless the right key is sent; constant-time check."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from serving.frontend.http.middleware.auth import key_matches
from tests.server_util import TEST_KEY

KEY = TEST_KEY


@pytest.fixture
def server(keyed_server):
    return keyed_server


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {KEY}x"},
        {"authorization": KEY},
        {"x-api-key": KEY[:-1]},
    ],
)
def test_missing_or_wrong_key_is_401(server, headers):
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = server.post(path, {"prompt": "x"}, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/debug/state", headers=headers).status_code == 401
    for path, body in (
        ("/pause_generation", {"mode": "drain"}),
        ("/continue_generation", {}),
        ("/control/tracing", {"sampling_ratio": 0.5}),
        ("/control/log_level", {"level": "debug"}),
    ):
        assert server.post(path, body, headers=headers).status_code == 401, path  # from loopback too
    assert httpx.get(server.url + "/control/config", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").json()["reason"] != "paused"


def test_right_key_works_and_probes_stay_open(server):
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/livez").status_code == 200  # the liveness probe sends no key either
    assert httpx.get(server.url + "/metrics").status_code == 200  # --auth-metrics is off by default
    auth = {"authorization": f"Bearer {KEY}"}
    config = httpx.get(server.url + "/control/config", headers=auth)
    assert config.status_code == 200 and KEY not in config.text  # the effective configuration, secrets hidden
    assert server.post("/pause_generation", {"mode": "drain"}, headers=auth).status_code == 200
    assert httpx.get(server.url + "/health").json()["reason"] == "paused"
    assert server.post("/continue_generation", {}, headers=auth).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert KEY not in server.log()


def test_openai_client_with_key(server):
    import openai

    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="tiny-random", prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_check_time_does_not_depend_on_how_much_matches():
    digest = hashlib.sha256(KEY.encode()).digest()
    candidates = {"prefix": KEY[:-1] + "X", "first": "X" + KEY[1:], "short": "X", "long": KEY * 50}

    def timings(names: tuple[str, ...], rounds: int = 40) -> dict[str, float]:
        """Fastest time of 500 checks per candidate over the rounds, the candidates interleaved in every
        round: a round another process preempted is slower, never faster, so the minimum of each is its
        undisturbed time even on one core shared with a busy neighbour (a median is not, there)."""
        runs: dict[str, list[int]] = {n: [] for n in names}
        for _ in range(rounds):
            for n in names:
                t0 = time.perf_counter_ns()
                for _ in range(500):
                    key_matches(digest, candidates[n])
                runs[n].append(time.perf_counter_ns() - t0)
        return {n: min(r) for n, r in runs.items()}

    assert key_matches(digest, KEY) and not any(key_matches(digest, c) for c in candidates.values())
    t = timings(("first", "prefix", "short"))
    assert 0.7 < t["prefix"] / t["first"] < 1.4
    assert 0.7 < t["short"] / t["first"] < 1.4
