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

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=12,
)
ANY = JSON | st.just(float("inf")) | st.integers(min_value=-(2**70), max_value=2**70)
NUM = st.integers(-3, 70) | st.floats(-5, 300, allow_nan=False) | st.none() | st.text(max_size=3)
SAMPLING = {
    "max_tokens": NUM,
    "temperature": NUM,
    "top_p": NUM,
    "top_k": NUM,
    "min_p": NUM,
    "n": NUM,
    "seed": NUM,
    "frequency_penalty": NUM,
    "presence_penalty": NUM,
    "repetition_penalty": NUM,
    "stream": st.booleans() | ANY,
    "stop": st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | ANY,
    "ignore_eos": st.booleans() | ANY,
    "logprobs": st.none() | NUM,
    "stream_options": st.none() | ANY,
    "model": st.sampled_from(["tiny-random", "other"]) | ANY,
    "stop_token_ids": st.lists(NUM, max_size=3),
}
PROMPT = st.text(max_size=80) | st.lists(st.integers(-5, 60000), max_size=30) | ANY
MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "x"]) | ANY, "content": st.text(max_size=60) | ANY}
        ),
        max_size=4,
    )
    | ANY
)


def body_for(path: str):
    extra = st.fixed_dictionaries({}, optional=SAMPLING)
    if path == "/v1/completions":
        core = st.fixed_dictionaries({}, optional={"prompt": PROMPT})
    elif path == "/v1/chat/completions":
        core = st.fixed_dictionaries({}, optional={"messages": MESSAGES})
    else:
        core = st.fixed_dictionaries(
            {},
            optional={
                "text": st.text(max_size=60) | ANY,
                "input_ids": PROMPT,
                "sampling_params": extra | ANY,
                "stream": st.booleans() | ANY,
            },
        )
    return st.one_of(st.builds(lambda a, b: {**a, **b}, core, extra), JSON)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--context-length", "64", tmpdir=tmp_path_factory.mktemp("fuzz"))
    yield srv
    srv.stop()


SENT = {"n": 0}
FUZZ = settings(
    max_examples=170, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
FUZZ_SMALL = settings(FUZZ, max_examples=60)


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
    @given(
        st.binary(max_size=200),
        st.sampled_from(
            [
                "/v1/completions",
                "/v1/chat/completions",
                "/generate",
                "/v1/models",
                "/health",
                "/metrics",
                "/debug/requests/x",
                "/x",
            ]
        ),
        st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
        st.text(max_size=8),
    )
    def run(raw, path, method, timeout):
        headers = {"content-type": "application/json"}
        if timeout.isprintable() and timeout.isascii() and timeout == timeout.strip():  # else httpx refuses it
            headers["x-request-timeout"] = timeout
        check(server, method, path, content=raw, headers=headers)

    run()


# -- extreme values, nesting, list lengths, content types ------------------------------
EDGE_INT = st.sampled_from(
    [2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]
) | st.integers(-(2**66), 2**66)
EDGE_NUM = EDGE_INT | st.sampled_from([1e308, -1e308, 5e-324, 1e-300, 0.0, -0.0])
RANGE_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
RANGE_BODY = st.fixed_dictionaries(
    {"prompt": st.just("range"), "stream": st.booleans()},
    optional={f: EDGE_NUM for f in RANGE_FIELDS} | {"stop_token_ids": st.lists(EDGE_INT, max_size=3)},
)


class BatchMates:
    """Greedy streams running beside the fuzzing: each must finish normally (finish_reason length)."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.stop, self.results = url, threading.Event(), []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        body = {"prompt": "mate", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            self.results.append(
                (
                    r.status_code,
                    events[-1]["choices"][0]["finish_reason"] if events else None,
                    sum(len(e["choices"][0]["text"]) > 0 for e in events),
                )
            )

    def finish(self) -> list:
        self.stop.set()
        self.thread.join(120)
        return self.results


def test_fuzz_parameter_ranges_never_hurt_batch_mates(server):
    """Extreme numbers (≥ 2**63, ±1e308...) are refused with a 400 or served; a stream beside them is untouched."""
    mates = BatchMates(server.url)

    @FUZZ_SMALL
    @given(RANGE_BODY)
    def run(body):
        check(server, "POST", "/v1/completions", body=body, headers={"content-type": "application/json"})

    try:
        run()
        r = server.post("/v1/completions", {"prompt": "x", "top_k": 2**64 - 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    finally:
        results = mates.finish()
    assert results and all(status == 200 and finish == "length" for status, finish, _ in results), results


@pytest.mark.parametrize("depth", [200, 999, 1000, 5000, 100_000])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_deeply_nested_json_is_a_400(server, path, depth):
    key = {"/v1/completions": b"prompt", "/v1/chat/completions": b"tools", "/generate": b"text"}[path]
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        body = b'{"' + key + b'": ' + opener * depth + b"1" + closer * depth + b"}"
        r = server.post(path, body)
        SENT["n"] += 1
        if depth < 999:  # within msgspec's depth limit: an ordinary (if odd) body, refused or served
            assert r.status_code < 500, (depth, r.status_code, r.text[:200])
            continue
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in server.log()


@FUZZ_SMALL
@given(st.sampled_from(["stop_token_ids", "stop", "messages", "prompt_ids"]), st.integers(0, 5000))
def test_fuzz_list_lengths_are_bounded(server, field, n):
    SENT["n"] += 1
    if field == "stop_token_ids":
        body, path = {"prompt": "x", "max_tokens": 2, "stop_token_ids": [7] * n}, "/v1/completions"
    elif field == "stop":
        body, path = {"prompt": "x", "max_tokens": 2, "stop": ["s"] * n}, "/v1/completions"
    elif field == "messages":
        body, path = {"messages": [{"role": "user", "content": ""}] * n, "max_tokens": 2}, "/v1/chat/completions"
    else:
        body, path = {"prompt": [5] * n, "max_tokens": 1}, "/v1/completions"
    r = server.post(path, body)
    assert r.status_code in (200, 400), (field, n, r.status_code, r.text[:200])
    if r.status_code == 400:
        assert r.json()["error"]["param"] in ("stop_token_ids", "stop", "messages", "prompt"), r.text
    elif field != "prompt_ids":
        assert n <= 64, (field, n)  # any list longer than every documented bound is refused


@FUZZ_SMALL
@given(
    st.sampled_from(
        [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/json",
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "application/vnd.api+json",
            "text/json",
            "",
            "application/jsonx",
        ]
    ),
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
)
def test_fuzz_content_types(server, ctype, path):
    """A POST with a body must say it is JSON (415 otherwise): cross-site forms and text/plain fetches can't."""
    SENT["n"] += 1
    body = json.dumps({"prompt": "x", "text": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    media = ctype.split(";")[0].strip().lower()
    is_json = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
    if is_json:
        assert r.status_code != 415, (ctype, r.text[:200])
    else:
        assert r.status_code == 415, (ctype, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "unsupported_media_type"


def test_server_healthy_after_fuzzing(server):
    assert SENT["n"] >= 500, SENT
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    state = server.debug()
    assert state["in_flight"] == 0
    print(f"fuzz: {SENT['n']} generated requests, no 5xx, server healthy")
