"""The prefix cache through the whole stack: cached tokens in `usage`, metrics that add up,
the prefill span's attribute, /flush_cache, and a server with the cache off."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers import encode
from tests.server_util import HOLD, ServerProc, scrape, sse_events, stream, value, wait_until

SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in one short sentence, cite the order "
    "number when one is given, and never promise delivery dates. "
) * 3
PROMPT = SYSTEM + "Where is my parcel?"
HITS, QUERIES = "sightline_prefix_cache_hits_tokens_total", "sightline_prefix_cache_queries_tokens_total"


def _flush(srv: ServerProc, **body) -> httpx.Response:
    return srv.post("/flush_cache", body if body else b"")


def _idle_kv(srv: ServerProc) -> dict:
    """The Scheduler's state once every request sent so far has ended: it must be idle."""
    srv.barrier()
    s = srv.debug()["scheduler"]
    assert s["num_running"] == 0 and s["kv_reserved"] == 0, s
    return s


def test_cached_tokens_in_usage_metrics_and_spans(tiny_server, tiny):
    assert _flush(tiny_server).status_code == 200
    n_prompt = len(encode(tiny, PROMPT))
    tiny_server.barrier()  # the engine's counts so far are in
    before = scrape(tiny_server)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    cold = tiny_server.post("/v1/completions", body).json()
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    events = stream(tiny_server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    usage_chunk = events[-2]
    warm_cached = usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm_cached == n_prompt - 1  # all but the last prompt token, whose logits give the first token
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == cold["choices"][0]["text"]
    assert usage_chunk["sightline"]["cached_tokens"] == warm_cached  # the breakdown shows it too
    # a chat turn sharing only the system text still reuses a prefix (the template's header + SYSTEM)
    chat = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    first_chat = tiny_server.post("/v1/chat/completions", chat).json()["usage"]
    second = tiny_server.post(
        "/v1/chat/completions",
        {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "Is my order 1234 late?"}]},
    )
    chat_usage = second.json()["usage"]
    assert chat_usage["prompt_tokens_details"]["cached_tokens"] > len(encode(tiny, SYSTEM)) // 2
    tiny_server.barrier()  # the engine's counts of these four requests are in
    after = scrape(tiny_server)
    client_cached = (
        warm_cached
        + first_chat["prompt_tokens_details"]["cached_tokens"]
        + chat_usage["prompt_tokens_details"]["cached_tokens"]
    )
    client_prompt = 2 * n_prompt + first_chat["prompt_tokens"] + chat_usage["prompt_tokens"]
    assert value(after, HITS) - value(before, HITS) == client_cached
    assert value(after, QUERIES) - value(before, QUERIES) == client_prompt
    assert value(after, "sightline_prefix_cache_tokens") > 0
    # the prefill span of the warm request carries the OpenTelemetry GenAI cache attribute
    rid = second.headers["x-request-id"]

    def prefill_span():
        entry = httpx.get(f"{tiny_server.url}/debug/requests/{rid}").json()
        return [s for s in entry.get("spans", []) if s["name"] == "prefill"]

    spans = wait_until(prefill_span, 10, "the prefill span")
    assert (
        spans[0]["attributes"]["gen_ai.usage.cache_read.input_tokens"]
        == chat_usage["prompt_tokens_details"]["cached_tokens"]
    )


def test_flush_cache_refused_while_requests_run_unless_forced(tiny_server):
    tiny_server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})  # something cached
    before = scrape(tiny_server)
    held_body = {
        "prompt": "count with me",
        "max_tokens": 8,
        "stream": True,
        **HOLD,
        "stream_options": {"include_usage": True},
    }
    events: list = []

    def run():
        with httpx.stream("POST", tiny_server.url + "/v1/completions", json=held_body, timeout=120) as r:
            events.extend(sse_events(r.iter_lines()))

    t = threading.Thread(target=run)
    t.start()
    try:
        tiny_server.wait_held(1)  # running (held) until released
        refused = _flush(tiny_server)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "requests_running", refused.text
        forced = _flush(tiny_server, force=True)
        assert forced.status_code == 200 and forced.json()["flushed_tokens"] > 0, forced.text
    finally:
        tiny_server.release()
        t.join(30)
    # the forced flush left the running request whole: it ends normally with every token
    assert events[-1] == "[DONE]" and events[-3]["choices"][0]["finish_reason"] == "length", events[-3:]
    assert events[-2]["usage"]["completion_tokens"] == 8
    _idle_kv(tiny_server)
    ok = _flush(tiny_server)
    assert ok.status_code == 200
    # flushed when idle: the pool is empty
    tiny_server.barrier()
    assert tiny_server.debug()["scheduler"]["kv_used"] == 0
    assert tiny_server.debug()["scheduler"]["prefix_cached_tokens"] == 0
    assert _flush(tiny_server, force="yes").status_code == 400  # not a boolean
    after = scrape(tiny_server)
    for result, n in (("refused", 1), ("ok", 2), ("error", 1)):
        assert (
            value(after, "sightline_prefix_cache_flushes_total", result=result)
            - value(before, "sightline_prefix_cache_flushes_total", result=result)
            == n
        ), result


@pytest.fixture(scope="module")
def uncached_server(tmp_path_factory):
    srv = ServerProc("--disable-prefix-cache", tmpdir=tmp_path_factory.mktemp("uncached"))
    yield srv
    srv.stop()


def test_cache_off_gives_the_same_text_and_no_hits(tiny_server, uncached_server):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    tiny_server.post("/v1/completions", body)  # warm the cache
    warm = tiny_server.post("/v1/completions", body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for _ in range(2):
        off = uncached_server.post("/v1/completions", body).json()
        assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert off["choices"][0]["text"] == warm["choices"][0]["text"]
    r = _flush(uncached_server)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prefix_cache_disabled"
    uncached_server.barrier()  # the engine's counts are in
    text = scrape(uncached_server)
    assert value(text, HITS) == 0 and value(text, QUERIES) > 0
