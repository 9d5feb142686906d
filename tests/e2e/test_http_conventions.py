"""HTTP habits clients rely on, against real servers (tiny-random):

* `x-request-id` and a valid W3C `traceparent` on every response: generations (the rid,
  the server span), the ops endpoints, and what middleware or routing refuse (401, 400 Host,
  413, 415, 429, 404, 405, a CORS preflight, the 503 of a connection over the limit, a 500);
* CORS off unless `--allowed-origins` names the page's origin;
* vLLM's `stream_options.continuous_usage_stats`: the running usage on every chunk.
"""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from serving.args import ServerArgs
from serving.frontend.http.middleware.guard import allowed_origins
from serving.frontend.http.server import fresh_traceparent
from tests.helpers import encode
from tests.server_util import HOLD, ServerProc, chat_ids, sse_events, wait_until

KEY = "sk-conventions-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
ORIGIN = "http://a.example"
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
INCOMING = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory):
    """API key, CORS for one origin, small limits (413, 429 and the connection cap are easy to reach)."""
    srv = ServerProc(
        "--allowed-origins",
        ORIGIN,
        "--max-request-bytes",
        "2048",
        "--max-inflight-tokens",
        "64",
        "--max-connections",
        "24",
        "--keep-alive-timeout",
        "1",
        tmpdir=tmp_path_factory.mktemp("conventions"),
        env={"SIGHTLINE_API_KEY": KEY},
    )
    yield srv
    srv.stop()


def ids_of(r: httpx.Response) -> tuple[str, str]:
    """The response's (x-request-id, traceparent), checked for shape."""
    rid, tp = r.headers.get("x-request-id"), r.headers.get("traceparent")
    assert rid and re.fullmatch(r"[0-9a-f]{32}", rid), (r.status_code, r.request.url, dict(r.headers))
    assert tp and TRACEPARENT.fullmatch(tp) and TRACEPARENT.fullmatch(tp).group(1).strip("0"), tp
    return rid, tp


def sampled(tp: str) -> bool:
    return int(tp[-2:], 16) & 1 == 1


# -- x-request-id and traceparent -------------------------------------------------------------
def test_generation_responses_carry_the_rid_and_the_server_span(tiny_server):
    r = tiny_server.post("/v1/completions", {"prompt": "hello", "max_tokens": 3}, headers={"traceparent": INCOMING})
    rid, tp = ids_of(r)
    assert r.status_code == 200 and r.json()["id"] == f"cmpl-{rid}"
    assert tp.split("-")[1] == INCOMING.split("-")[1] == r.json()["sightline"]["trace_id"] and sampled(tp)
    assert tp.split("-")[2] != INCOMING.split("-")[2]  # the server span, a child of the client's
    with httpx.stream(
        "POST",
        tiny_server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    ) as s:
        rid, tp = ids_of(s)
        events = sse_events(s.iter_lines())
    assert events[0]["id"] == f"chatcmpl-{rid}" and sampled(tp)
    gen = tiny_server.post("/generate", {"text": "hi", "rid": "mine", "sampling_params": {"max_new_tokens": 2}})
    assert gen.json()["meta_info"]["id"] == "mine" and ids_of(gen)[0] != "mine"


def test_incoming_x_request_id_is_not_echoed(tiny_server):
    """The server's ids are its own, fresh per request: a client's header is ignored (as before)."""
    r = tiny_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"x-request-id": "client-1"})
    assert ids_of(r)[0] != "client-1" and r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
    h = httpx.get(tiny_server.url + "/health", headers={"x-request-id": "client-2"})
    assert ids_of(h)[0] != "client-2"


def test_ops_endpoints_and_routing_errors_carry_ids(tiny_server):
    seen = set()
    for method, path, status in [
        ("GET", "/health", 200),
        ("GET", "/metrics", 200),
        ("GET", "/v1/models", 200),
        ("GET", "/debug/state", 200),
        ("GET", "/debug/requests?limit=1", 200),
        ("GET", "/debug/requests/nope", 404),
        ("GET", "/no/such/route", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/health", 405),
    ]:
        r = httpx.request(method, tiny_server.url + path, headers={"traceparent": INCOMING}, timeout=10)
        assert r.status_code == status, (path, r.text)
        rid, tp = ids_of(r)
        # no server span stands behind these: the client's trace id, a fresh span id, not sampled
        assert tp.split("-")[1] == INCOMING.split("-")[1] and not sampled(tp), (path, tp)
        seen.add(rid)
    assert len(seen) == 9  # one id per HTTP request
    plain = httpx.get(tiny_server.url + "/health")
    assert ids_of(plain)[1].split("-")[1] != INCOMING.split("-")[1]  # no incoming context: a new trace id


def test_refusals_carry_ids(cors_server):
    url = cors_server.url
    cases = {
        "401 no key": httpx.post(url + "/v1/completions", json={"prompt": "x"}),
        "400 host": httpx.get(url + "/health", headers={"host": "evil.example"}),
        "415 text/plain": httpx.post(
            url + "/v1/completions", content=b'{"prompt": "x"}', headers={**AUTH, "content-type": "text/plain"}
        ),
        "413 body": httpx.post(url + "/v1/completions", json={"prompt": "x" * 3000}, headers=AUTH),
        "400 bad json": httpx.post(
            url + "/v1/completions", content=b"{", headers={**AUTH, "content-type": "application/json"}
        ),
    }
    statuses = {name: r.status_code for name, r in cases.items()}
    assert statuses == {
        "401 no key": 401,
        "400 host": 400,
        "415 text/plain": 415,
        "413 body": 413,
        "400 bad json": 400,
    }, statuses
    for name, r in cases.items():
        ids_of(r)
        assert "error" in r.json(), name
    assert cases["401 no key"].headers["www-authenticate"] == "Bearer"


def test_429_carries_ids_and_cors_headers(cors_server):
    # its 81 prompt tokens alone are over --max-inflight-tokens 64 (a request alone is always let in)
    body = {"prompt": "go on " * 40, "max_tokens": 8, "stream": True, **HOLD}
    with httpx.stream("POST", cors_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as s:
        assert s.status_code == 200
        cors_server.wait_held(1)  # running (held until the stream closes): its tokens are in flight
        r = httpx.post(
            cors_server.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 8},
            headers={**AUTH, "origin": ORIGIN},
        )
    cors_server.wait_held(0)  # closing the stream cut it
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_full", r.text
    ids_of(r)
    assert r.headers["access-control-allow-origin"] == ORIGIN and int(r.headers["retry-after"]) >= 1
    exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "traceparent", "retry-after"} <= exposed


def test_connection_over_the_cap_gets_a_503_with_ids(cors_server):
    host, port = cors_server.url.removeprefix("http://").split(":")
    socks, refusal = [], b""
    try:
        # 40 at once against a cap of 24, faster than the 1 s idle timer closes any of them
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(40)]
        for s in reversed(socks):  # the refused ones are the last opened
            s.settimeout(0.5)
            try:
                refusal = s.recv(4096)
            except socket.timeout:
                continue
            if refusal.startswith(b"HTTP/1.1 503"):
                break
    finally:
        for s in socks:
            s.close()
    head = refusal.split(b"\r\n\r\n")[0].decode()
    assert head.startswith("HTTP/1.1 503"), refusal
    assert re.search(r"\r\nx-request-id: [0-9a-f]{32}\r\n", head), head
    assert re.search(r"\r\ntraceparent: 00-[0-9a-f]{32}-[0-9a-f]{16}-00\r\n", head), head
    time.sleep(1.5)  # clock: closed connections count until their idle timer (--keep-alive-timeout 1) ends
    wait_until(lambda: _health_ok(cors_server), 10, "the server accepting again below its connection cap")


def _health_ok(srv) -> bool:
    try:
        return httpx.get(srv.url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_unhandled_error_500_carries_ids():
    """The 500 handler runs outside the middleware stack: it adds the ids itself."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from serving.frontend.http import app as app_module
    from serving.frontend.http.middleware.response_ids import ResponseIdsMiddleware

    async def boom(request):
        raise RuntimeError("boom")

    app = Starlette(
        routes=[Route("/boom", boom)],
        middleware=[Middleware(ResponseIdsMiddleware)],
        exception_handlers={Exception: app_module._internal_error},
    )
    r = TestClient(app, raise_server_exceptions=False).get("/boom", headers={"traceparent": INCOMING})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert r.headers["traceparent"].split("-")[1] == INCOMING.split("-")[1]


def test_fresh_traceparent_is_valid_for_any_input():
    trace = INCOMING.split("-")[1]
    for incoming, keeps in [
        (INCOMING, True),
        (INCOMING.upper(), True),
        ("", False),
        ("junk", False),
        ("ff-" + INCOMING[3:], False),
        ("00-" + "0" * 32 + INCOMING[35:], False),
    ]:
        tp = fresh_traceparent(incoming)
        assert TRACEPARENT.fullmatch(tp) and tp.endswith("-00") and (tp.split("-")[1] == trace) == keeps, incoming


# -- CORS ---------------------------------------------------------------------------------------
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type"}


def test_cors_is_off_by_default(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/models", headers={"origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(tiny_server.url + "/v1/chat/completions", headers={"origin": ORIGIN, **PREFLIGHT})
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
    assert "access-control-allow-methods" not in pre.headers
    ids_of(pre)


def test_cors_preflight_for_the_allowed_origin_only(cors_server):
    url = cors_server.url + "/v1/chat/completions"
    ok = httpx.options(url, headers={"origin": ORIGIN, **PREFLIGHT})  # no key: preflights never carry one
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert ok.headers["access-control-allow-headers"] == PREFLIGHT["access-control-request-headers"]
    ids_of(ok)
    other = httpx.options(url, headers={"origin": "http://b.example", **PREFLIGHT})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    ids_of(other)


def test_cors_headers_on_streaming_and_non_streaming_responses(cors_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(cors_server.url + "/v1/chat/completions", json=body, headers={**AUTH, "origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    with httpx.stream(
        "POST",
        cors_server.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers={**AUTH, "origin": ORIGIN},
        timeout=60,
    ) as s:
        assert s.status_code == 200 and s.headers["access-control-allow-origin"] == ORIGIN
        assert sse_events(s.iter_lines())[-1] == "[DONE]"
    denied = httpx.post(cors_server.url + "/v1/chat/completions", json=body, headers={"origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN  # readable
    other = httpx.post(
        cors_server.url + "/v1/chat/completions", json=body, headers={**AUTH, "origin": "http://b.example"}
    )
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_allowed_origins_flag():
    assert allowed_origins("http://a.example/, https://b.example:8443") == [
        "http://a.example",
        "https://b.example:8443",
    ]
    assert allowed_origins("*") == ["*"] and allowed_origins(None) == []
    for bad in ("a.example", "http://a.example/app", "ftp://a.example"):
        with pytest.raises(ValueError, match="allowed-origins"):
            ServerArgs(allowed_origins=bad)


# -- continuous usage -----------------------------------------------------------------------
def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_running_usage_on_every_chunk(tiny_server, tiny, path):
    chat = path.endswith("chat/completions")
    prompt = "Count to ten"
    body = {
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 0,
        **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
    }
    n_prompt = len(chat_ids(tiny, prompt) if chat else encode(tiny, prompt))
    chunks = _stream(
        tiny_server, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )
    *deltas, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    running = [c["usage"] for c in deltas]
    assert all(
        u["prompt_tokens"] == n_prompt and u["total_tokens"] == n_prompt + u["completion_tokens"] for u in running
    ), running
    counts = [u["completion_tokens"] for u in running]
    assert counts == sorted(counts) and counts[-1] == 8 and (counts[0] == 0) == chat, counts
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    # without it: `usage: null` on every chunk and the final usage chunk; without include_usage, no usage at all
    plain = _stream(tiny_server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 8
    alone = _stream(tiny_server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in alone) and alone[-1]["choices"]  # as vLLM: needs include_usage
