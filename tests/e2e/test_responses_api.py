"""`/v1/responses` against one real SmolLM2 server: the response object and every streamed event validated
with the `openai` package's own types, function tools and `text.format` through the chat route's grammar,
the store (follow-up turns, retrieve, delete, input items, its bound), bad input refused in OpenAI's error
shape before the engine, the telemetry (span, endings table, Server-Timing, flight record) and a replay of
the recorded requests; then the `openai` client and the Agents SDK's default model (.venv-clients).
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from loadtest.records import RequestRecord as ClientRecord
from loadtest.replay.readers import reader_class
from loadtest.replay.run import make_items, plan_schedule
from telemetry.request_record import read_records
from tests.client_venv import drive, need_clients_venv
from tests.e2e.test_structured_outputs import engine_work
from tests.server_util import ServerProc, scrape, sse_events, value, wait_until

pytestmark = [pytest.mark.smollm]

PATH = "/v1/responses"
STORE = 3
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's own default
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    need_clients_venv()
    tmp = tmp_path_factory.mktemp("responses")
    server = ServerProc(
        "--quantization",
        "none",
        "--responses-store-size",
        str(STORE),
        "--dump-requests",
        str(tmp / "dump"),
        "--dump-content",
        model="smollm2-135m",
        tmpdir=tmp,
    )
    server.dump = tmp / "dump"
    yield server
    server.stop()


def create(srv: ServerProc, body: dict) -> tuple[httpx.Response, dict]:
    r = srv.post(PATH, {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # the openai package's own type
    return r, r.json()


def streamed(srv: ServerProc, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + PATH, json={"temperature": 0, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    for ev in events:
        EVENTS.validate_python(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    return events


def check_usage(usage: dict, max_output: int) -> None:
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= max_output
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def text_of(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


def test_create_answers_with_text_usage_and_the_chat_routes_telemetry(srv):
    before = value(scrape(srv), "sightline_requests_total", outcome="stop")
    r, body = create(srv, {"input": "What is the capital of France?", "instructions": SYSTEM, "max_output_tokens": 16})
    assert body["id"] == f"resp_{r.headers['x-request-id']}" and body["object"] == "response"
    assert "Paris" in text_of(body) and body["status"] == "completed" and body["incomplete_details"] is None
    check_usage(body["usage"], 16)
    assert (body["instructions"], body["max_output_tokens"], body["store"]) == (SYSTEM, 16, True)
    assert r.headers["server-timing"].startswith("queue;dur=") and body["sightline"]["ttft_ms"] > 0
    text = scrape(srv)
    assert value(text, "sightline_requests_total", outcome="stop") == before + 1  # the endings table
    for histogram in (
        "sightline_time_to_first_token_seconds",
        "sightline_e2e_request_latency_seconds",
        "sightline_request_generation_tokens",
    ):  # the generation histograms, by route
        assert value(text, histogram + "_count", route=PATH) == 1, histogram
    assert value(text, "sightline_request_generation_tokens_sum", route=PATH) == body["usage"]["output_tokens"]
    entry = httpx.get(f"{srv.url}/debug/requests/{r.headers['x-request-id']}").json()
    assert entry["route"] == PATH and entry["prompt_tokens"] == body["usage"]["input_tokens"]
    assert entry["spans"][0]["name"] == f"POST {PATH}"


def test_a_stream_is_openais_typed_events_and_says_what_the_whole_response_says(srv):
    question = {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
        "max_output_tokens": 8,
    }
    events = streamed(srv, question)
    kinds = [ev["type"] for ev in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1]["response"]
    deltas = "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta")
    assert deltas and deltas == text_of(final) == events[-4]["text"]
    assert final["usage"]["output_tokens"] == 8 and final["incomplete_details"] == {"reason": "max_output_tokens"}
    _, whole = create(srv, {**question, "store": False})
    assert text_of(whole) == deltas and whole["usage"]["input_tokens"] == final["usage"]["input_tokens"]


def test_a_function_tool_is_called_streamed_or_not(srv):
    body = {
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 40,
        "store": False,
    }
    _, whole = create(srv, body)
    [call] = whole["output"]
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "completed")
    assert isinstance(json.loads(call["arguments"])["city"], str) and call["call_id"]
    assert whole["status"] == "completed"
    events = streamed(srv, body)
    kinds = [ev["type"] for ev in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(ev for ev in events if ev["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == call["arguments"] and done["name"] == "get_weather"
    assert events[-1]["type"] == "response.completed"


def test_text_format_json_schema_shapes_the_answer(srv):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "people": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "people"],
    }
    _, body = create(
        srv,
        {
            "input": "Paris has 2 million people. Extract it.",
            "max_output_tokens": 40,
            "text": {"format": {"type": "json_schema", "name": "City", "schema": schema}},
            "store": False,
        },
    )
    parsed = json.loads(text_of(body))
    assert set(parsed) == {"city", "people"} and 0 <= parsed["people"] <= 99
    assert body["text"]["format"]["name"] == "City" and body["status"] == "completed"


def test_stored_responses_are_retrieved_listed_deleted_and_bounded(srv):
    text = scrape(srv)
    evicted, held = value(text, "sightline_responses_store_evictions_total"), value(text, "sightline_responses_stored")
    ids = [create(srv, {"input": f"Count to {i}.", "max_output_tokens": 1})[1]["id"] for i in range(STORE + 1)]
    first, last = ids[0], ids[-1]
    assert httpx.get(f"{srv.url}{PATH}/{first}").status_code == 404  # the least recently used went
    r = srv.post(PATH, {"input": "again", "previous_response_id": first})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    text = scrape(srv)
    assert value(text, "sightline_responses_store_evictions_total") == evicted + held + 1  # each one counted
    assert value(text, "sightline_responses_stored") == STORE
    got = httpx.get(f"{srv.url}{PATH}/{last}").json()
    assert got["id"] == last and got["usage"]["output_tokens"] == 1
    items = httpx.get(f"{srv.url}{PATH}/{last}/input_items").json()
    assert [i["content"][0]["text"] for i in items["data"]] == [f"Count to {STORE}."] and not items["has_more"]
    assert httpx.delete(f"{srv.url}{PATH}/{last}").json() == {"id": last, "object": "response.deleted", "deleted": True}
    gone = httpx.get(f"{srv.url}{PATH}/{last}")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == f"Response with id '{last}' not found."
    unstored = create(srv, {"input": "hi", "max_output_tokens": 1, "store": False})[1]["id"]
    assert httpx.get(f"{srv.url}{PATH}/{unstored}").status_code == 404


BAD = [  # (body, the param named)
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strnig"}}}},
        "text.format.schema",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x" * 200_000}, "input"),
    ({"input": "x", "colour": "red"}, "colour"),
]


def test_bad_input_is_a_400_naming_the_field_before_the_engine(srv):
    before = engine_work(srv)
    rejected = value(scrape(srv), "sightline_requests_total", status="400", outcome="rejected")
    for body, param in BAD:
        r = srv.post(PATH, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (body, err)
    assert engine_work(srv) == before  # none reached the Scheduler
    assert value(scrape(srv), "sightline_requests_total", status="400", outcome="rejected") == rejected + len(BAD)
    check_usage(create(srv, {"input": "Hello!", "max_output_tokens": 2, "store": False})[1]["usage"], 2)


def test_recorded_requests_replay_as_responses_bodies(srv):
    """The flight recorder's /v1/responses records, turned into requests by the replay's own code and sent:
    the same route, streamed or not, exactly the recorded prompt and output tokens.  A record keeps the
    messages, not the tools (as on chat): requests that had tools are left out of the comparison."""

    def recorded():
        return [
            r
            for r in read_records(srv.dump)
            if r.route == PATH and r.outcome in ("stop", "length") and "weather" not in json.dumps(r.prompt)
        ]

    records = wait_until(lambda: len(recorded()) >= 4 and recorded(), 10, "the records of this module's requests")
    assert {r.stream for r in records} == {True, False}
    planned, _ = plan_schedule(records[:6])
    for item in make_items(planned, "smollm2-135m", None):
        rec = next(r for r in records if r.rid == item.rid)
        assert item.path == PATH and item.body["input"] and item.body["store"] is False
        reader = reader_class(item)(ClientRecord("replay", "responses", 0, 0.0, 0.0, 0.0), 0.0)
        with httpx.stream("POST", srv.url + item.path, json=item.body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for chunk in r.iter_bytes():
                reader.feed(chunk, 0.0)
        got = reader.finish(0.0)
        assert got.error is None, got.error
        assert (got.prompt_tokens, got.completion_tokens) == (rec.prompt_tokens, rec.completion_tokens)
        assert reader.server["e2e_ms"] > 0


@pytest.fixture(scope="module")
def clients() -> dict[str, dict]:
    """The scenarios' results, each driven on first use (this module's server only)."""
    return {}


def client(clients: dict, srv: ServerProc, scenario: str) -> dict:
    """A scenario's result: tests/client_venv.py's one client interpreter runs it once for the module."""
    if scenario not in clients:
        clients[scenario] = drive(srv.url + "/v1", scenario)
    return clients[scenario]


def test_openai_client_create_follow_up_and_retrieve(srv, clients):
    result = client(clients, srv, "responses_turns")
    first, follow, alone = result["turns"]
    for turn in result["turns"]:
        assert turn["id"].startswith("resp_") and turn["text"].strip()
        check_usage(turn["usage"], 12)
    # the follow-up ran on the first turn too: its prompt holds both of that turn's messages
    assert follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert follow["usage"]["cached_tokens"] > 0  # the conversation's prefix was the first turn's
    assert result["retrieved"] == {"id": follow["id"], "text": follow["text"], "previous": first["id"]}


def test_openai_client_streams(srv, clients):
    result = client(clients, srv, "responses_streams")
    assert result["kinds"][0] == "response.created" and result["text"] == result["final_text"] != ""
    check_usage(result["usage"], 8)
    helper = result["helper"]  # responses.stream with a Pydantic text_format: parsed back by the client
    assert helper["type"] == "Color" and helper["parsed"]["color"] in ("red", "green", "blue")
    assert helper["status"] == "completed" and json.loads(helper["text"]) == helper["parsed"]
    check_usage(helper["usage"], 32)


def test_agents_sdk_default_model_runs_a_turn(srv, clients):
    result = client(clients, srv, "agents_responses_turn")
    assert result["model_class"] == "OpenAIResponsesModel" and result["items"] == ["MessageOutputItem"]
    assert "Paris" in result["final_output"] and result["response_ids"][0].startswith("resp_")
    assert result["usage"]["requests"] == 1 and 0 < result["usage"]["output_tokens"] <= 16
    assert result["usage"]["input_tokens"] > 0


def test_agents_sdk_default_model_calls_a_tool_and_answers(srv, clients):
    result = client(clients, srv, "agents_responses_tool_turn")
    assert result["calls"] and isinstance(result["calls"][0]["city"], str)
    assert result["items"][:2] == ["ToolCallItem", "ToolCallOutputItem"] and "MessageOutputItem" in result["items"]
    assert all(rid.startswith("resp_") for rid in result["response_ids"]) and result["final_output"].strip()
    assert result["usage"]["requests"] == len(result["response_ids"]) >= 2 and result["usage"]["output_tokens"] > 0
