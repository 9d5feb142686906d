"""Fuzzing every endpoint with generated requests: never a 5xx, never a hang, healthy after.

Hypothesis draws bodies that are mostly the right shape with wrong or extreme values,
plus arbitrary JSON and raw bytes.  The server runs with a 64-token context so any
accepted request is short.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_util import ServerProc

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
                    max_leaves=12)
ANY = JSON | st.just(float("inf")) | st.integers(min_value=-(2**70), max_value=2**70)
NUM = st.integers(-3, 70) | st.floats(-5, 300, allow_nan=False) | st.none() | st.text(max_size=3)
SAMPLING = {
    "max_tokens": NUM, "temperature": NUM, "top_p": NUM, "top_k": NUM, "min_p": NUM, "n": NUM, "seed": NUM,
    "frequency_penalty": NUM, "presence_penalty": NUM, "repetition_penalty": NUM, "stream": st.booleans() | ANY,
    "stop": st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | ANY,
    "ignore_eos": st.booleans() | ANY, "logprobs": st.none() | NUM, "stream_options": st.none() | ANY,
    "model": st.sampled_from(["tiny-random", "other"]) | ANY, "stop_token_ids": st.lists(NUM, max_size=3),
}
PROMPT = st.text(max_size=80) | st.lists(st.integers(-5, 60000), max_size=30) | ANY
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]) | ANY,
                                           "content": st.text(max_size=60) | ANY}), max_size=4) | ANY


def body_for(path: str):
    extra = st.fixed_dictionaries({}, optional=SAMPLING)
    if path == "/v1/completions":
        core = st.fixed_dictionaries({}, optional={"prompt": PROMPT})
    elif path == "/v1/chat/completions":
        core = st.fixed_dictionaries({}, optional={"messages": MESSAGES})
    else:
        core = st.fixed_dictionaries({}, optional={"text": st.text(max_size=60) | ANY, "input_ids": PROMPT,
                                                   "sampling_params": extra | ANY, "stream": st.booleans() | ANY})
    return st.one_of(st.builds(lambda a, b: {**a, **b}, core, extra), JSON)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--context-length", "64", tmpdir=tmp_path_factory.mktemp("fuzz"))
    yield srv
    srv.stop()


SENT = {"n": 0}
FUZZ = settings(max_examples=170, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def check(server, method: str, path: str, **kw) -> None:
    SENT["n"] += 1
    if "body" in kw:  # json.dumps writes inf as Infinity: not JSON, which the server must refuse cleanly
        kw["content"] = json.dumps(kw["body"])
    r = httpx.request(method, server.url + path, timeout=30, **{k: v for k, v in kw.items() if k != "body"})
    assert r.status_code < 500, (path, kw, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and "type" in err
    elif isinstance(kw.get("body"), dict) and kw["body"].get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_fuzz_json_bodies(server, path):
    @FUZZ
    @given(body_for(path))
    def run(body):
        check(server, "POST", path, body=body, headers={"content-type": "application/json"})

    run()


def test_fuzz_raw_bytes_headers_and_paths(server):
    @FUZZ
    @given(st.binary(max_size=200), st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate",
                                                     "/v1/models", "/health", "/metrics", "/debug/requests/x", "/x"]),
           st.sampled_from(["GET", "POST", "PUT", "DELETE"]), st.text(max_size=8))
    def run(raw, path, method, timeout):
        headers = {"content-type": "application/json"}
        if timeout.isprintable() and timeout.isascii():
            headers["x-request-timeout"] = timeout
        check(server, method, path, content=raw, headers=headers)

    run()


def test_server_healthy_after_fuzzing(server):
    assert SENT["n"] >= 500, SENT
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    state = server.debug()
    assert state["in_flight"] == 0
    print(f"fuzz: {SENT['n']} generated requests, no 5xx, server healthy")
