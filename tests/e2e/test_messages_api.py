"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on one real SmolLM2 server with an
API key and the flight recorder (`--dump-requests --dump-content`).

The `anthropic` SDK (tests/clients/drive.py in .venv-clients, the key sent as `x-api-key`) creates, streams,
calls a tool and sends its result back, counts tokens; its pydantic types validate the raw bodies and every
streamed event.  Over plain HTTP: the answer is the chat route's answer to the same prompt (one pipeline), the
events come in Anthropic's order, bad input is refused in Anthropic's error shape before the engine, an error
after the stream started is an `error` event, and a request is one span, one record, and replays as it was.
"""

from __future__ import annotations

import json

import httpx
import pytest

from loadtest.records import RequestRecord as ClientRecord
from loadtest.replay.readers import reader_class
from loadtest.replay.run import make_items, plan_schedule
from loadtest.replay.schedule import MESSAGES
from telemetry.request_record import read_records
from tests.client_venv import drive, need_clients_venv
from tests.server_util import HOLD, TEST_KEY, ServerProc, scrape, value, wait_until

pytestmark = pytest.mark.smollm

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
SYSTEM = "Answer in one short sentence."
ASK = {
    "model": MODEL,
    "max_tokens": 12,
    "temperature": 0,
    "system": SYSTEM,
    "messages": [{"role": "user", "content": QUESTION}],
}
KEY = {"x-api-key": TEST_KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    s = ServerProc(
        "--quantization",
        "none",
        "--dump-requests",
        str(tmp / "dump"),
        "--dump-content",
        model=MODEL,
        tmpdir=tmp,
        env={"SIGHTLINE_API_KEY": TEST_KEY},
    )
    s.dump = tmp / "dump"
    yield s
    s.stop()


def post(srv: ServerProc, body: dict, path: str = "/v1/messages", headers: dict | None = None) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=KEY if headers is None else headers, timeout=60)


def events(srv: ServerProc, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A streamed answer as (event name, data) pairs, each data's `type` its event's name."""
    out, name = [], None
    with httpx.stream(
        "POST", srv.url + "/v1/messages", json={**body, "stream": True}, headers={**KEY, **(headers or {})}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def client(srv: ServerProc, scenario: str) -> dict:
    need_clients_venv()
    return drive(srv.url + "/v1", scenario, env={"ANTHROPIC_API_KEY": TEST_KEY})


def test_the_answer_is_the_chat_routes_answer_to_the_same_prompt(srv):
    r = post(srv, ASK)
    assert r.status_code == 200, r.text
    msg = r.json()
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {TEST_KEY}"},
        timeout=60,
        json={
            "model": MODEL,
            "max_tokens": 12,
            "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        },
    ).json()
    assert msg["id"] == "msg_" + r.headers["x-request-id"] and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["model"] == MODEL and [b["type"] for b in msg["content"]] == ["text"]
    text = msg["content"][0]["text"]
    assert text == chat["choices"][0]["message"]["content"] and "Paris" in text
    assert msg["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    use = msg["usage"]
    assert use["input_tokens"] + use["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert use["output_tokens"] == chat["usage"]["completion_tokens"] and use["cache_creation_input_tokens"] == 0
    assert "total;dur=" in r.headers["server-timing"] and msg["sightline"]["e2e_ms"] > 0


def test_a_stream_is_anthropics_event_sequence_with_the_same_text(srv):
    whole = post(srv, ASK).json()
    evs = events(srv, ASK)
    names = [n for n, _ in evs]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    text = "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    end = evs[-2][1]
    assert end["delta"]["stop_reason"] == whole["stop_reason"]
    assert end["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert (
        end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
        == whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]
    )


def test_anthropic_client_create_and_a_stop_sequence(srv):
    out = client(srv, "anthropic_create")
    first, stopped = out["first"], out["stopped"]
    assert "Paris" in first["text"] and first["stop_reason"] in ("end_turn", "max_tokens")
    assert first["model"] == MODEL and first["types"] == ["text"] and 1 <= first["usage"]["output_tokens"] <= 12
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == out["stop"]
    assert first["text"].startswith(stopped["text"]) and out["stop"] not in stopped["text"]
    assert stopped["usage"]["output_tokens"] < first["usage"]["output_tokens"]


def test_anthropic_client_stream_text_and_final_message(srv):
    out = client(srv, "anthropic_stream")
    final = out["final"]
    assert "".join(out["pieces"]) == final["text"] and "Paris" in final["text"]
    assert final["stop_reason"] in ("end_turn", "max_tokens") and 1 <= final["usage"]["output_tokens"] <= 10
    assert final["usage"]["input_tokens"] + final["usage"]["cache_read_input_tokens"] > 10


def test_anthropic_client_tool_call_round_trip(srv):
    out = client(srv, "anthropic_tool_round_trip")
    (call,) = out["calls"]
    assert out["first"]["stop_reason"] == "tool_use" and out["first"]["types"] == ["tool_use"]
    assert call["name"] == "get_weather" and isinstance(call["input"]["city"], str) and call["id"]
    second = out["second"]
    assert (
        second["types"] == ["text"] and second["text"].strip() and second["stop_reason"] in ("end_turn", "max_tokens")
    )
    prompt = [m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] for m in (out["first"], second)]
    assert prompt[1] > prompt[0]  # the call and its result are in the second prompt


def test_anthropic_client_count_tokens_is_the_answers_input(srv):
    out = client(srv, "anthropic_count_tokens")
    use = out["usage"]
    assert out["counted"] == use["input_tokens"] + use["cache_read_input_tokens"] > 5


def test_bodies_and_events_validate_against_the_sdks_types(srv):
    out = client(srv, "anthropic_types")
    assert out["types"] == [["text"], ["tool_use"]]
    assert out["events"].count("message_start") == 2 and out["events"].count("message_stop") == 2
    assert "content_block_delta" in out["events"]


BAD = [  # (body, status, error type, words in the message): every one refused before the engine
    ({k: v for k, v in ASK.items() if k != "max_tokens"}, 400, "invalid_request_error", "max_tokens"),
    ({**ASK, "max_tokens": "12"}, 400, "invalid_request_error", "max_tokens"),
    (
        {**ASK, "messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "x"}]},
        400,
        "invalid_request_error",
        "first message must be a user turn",
    ),
    ({**ASK, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "unexpected role"),
    (
        {**ASK, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
        400,
        "invalid_request_error",
        "'image'",
    ),
    (
        {**ASK, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
        400,
        "invalid_request_error",
        "tool_result",
    ),
    ({**ASK, "messages": "hi"}, 400, "invalid_request_error", "messages"),
    ({**ASK, "model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
    ({**ASK, "temperature": 2}, 400, "invalid_request_error", "temperature"),
    ({**ASK, "top_logprobs": 2}, 400, "invalid_request_error", "top_logprobs"),
    (
        {**ASK, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
        400,
        "invalid_request_error",
        "tools[0].input_schema",
    ),
    ({**ASK, "messages": [{"role": "user", "content": "x" * 300_000}]}, 400, "invalid_request_error", "characters"),
]


def test_bad_input_is_refused_in_anthropics_shape_and_the_server_keeps_serving(srv):
    before = scrape(srv)
    for body, status, kind, words in BAD:
        r = post(srv, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()
        assert set(err) == {"type", "error"} and err["type"] == "error" and err["error"]["type"] == kind, err
        assert words in err["error"]["message"], err
    after = scrape(srv)
    assert value(after, "sightline_requests_total", outcome="rejected") - value(
        before, "sightline_requests_total", outcome="rejected"
    ) == len(BAD)
    assert value(after, "sightline_prompt_tokens_total") == value(before, "sightline_prompt_tokens_total")
    for path, method, headers, status, kind in [
        ("/v1/messages", "POST", {}, 401, "authentication_error"),
        ("/v1/messages", "POST", {"x-api-key": "wrong"}, 401, "authentication_error"),
        ("/v1/messages", "GET", KEY, 405, "invalid_request_error"),
        ("/v1/messages/batches", "POST", KEY, 404, "not_found_error"),
        ("/v1/messages/count_tokens", "POST", KEY, 400, "invalid_request_error"),
    ]:
        r = httpx.request(method, srv.url + path, json={"model": MODEL}, headers=headers, timeout=30)
        assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (status, "error", kind), r.text
    bearer = post(srv, {**ASK, "max_tokens": 2}, headers={"authorization": f"Bearer {TEST_KEY}"})
    assert bearer.status_code == 200 and bearer.json()["usage"]["output_tokens"] == 2


def test_an_error_after_the_stream_started_is_an_error_event(srv):
    """Held one token short of its end (the hold seam), the request outlives its deadline."""
    evs = events(srv, {**ASK, "max_tokens": 8, **HOLD}, headers={"x-request-timeout": "1"})
    assert evs[0][0] == "message_start" and evs[-1][0] == "error"
    assert evs[-1][1]["error"]["type"] == "timeout_error"
    assert post(srv, {**ASK, "max_tokens": 2}).json()["stop_reason"] == "max_tokens"


def test_one_span_one_record_and_a_replay_as_it_was(srv):
    r = post(srv, {**ASK, "max_tokens": 6, "stop_sequences": ["Berlin"]})
    rid = r.headers["x-request-id"]
    streamed = events(srv, {**ASK, "max_tokens": 4})[0][1]["message"]["id"].removeprefix("msg_")
    auth = {"authorization": f"Bearer {TEST_KEY}"}

    def spans():
        entry = httpx.get(f"{srv.url}/debug/requests/{rid}", headers=auth, timeout=10).json()
        return entry if "POST /v1/messages" in [s["name"] for s in entry.get("spans", [])] else None

    entry = wait_until(spans, 10, "the request's spans")
    assert entry["route"] == "/v1/messages"
    assert value(scrape(srv), "sightline_http_requests_total", route="/v1/messages", status="200") >= 1
    records = wait_until(
        lambda: len(rs := [x for x in read_records(srv.dump) if x.rid in (rid, streamed)]) == 2 and rs,
        15,
        "the two requests' records",
    )
    rec = next(x for x in records if x.rid == rid)
    assert rec.prompt == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert rec.operation == "chat" and rec.params["stop_strings"] == ["Berlin"] and rec.params["temperature"] == 0
    assert rec.prompt_tokens == r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"]
    planned, _ = plan_schedule(records)
    items = make_items(planned, MODEL, None)
    assert {it.stream for it in items} == {True, False}
    for it in items:
        assert it.path == MESSAGES and it.body["system"] == SYSTEM and it.body["ignore_eos"]
        reader = reader_class(it)(ClientRecord("replay", "messages", 0, 1.0, 0.0, 0.0), 0.0)
        with httpx.stream("POST", srv.url + it.path, json=it.body, headers=KEY, timeout=60) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_bytes():
                reader.feed(chunk, 0.0)
        got = reader.finish(0.0)
        assert got.ok, got.error
        recorded = next(x for x in records if x.rid == it.rid)
        assert (got.prompt_tokens, got.completion_tokens) == (recorded.prompt_tokens, recorded.completion_tokens)
