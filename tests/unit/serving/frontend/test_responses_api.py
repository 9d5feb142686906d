"""/v1/responses without a server: the body → the chat request it becomes, the chat chunks → OpenAI's typed
events (validated with the `openai` package's own types), the store's bound, and the replay's side (the
body a record becomes, the readers of a Responses stream and body)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from loadtest.records import RequestRecord as ClientRecord
from loadtest.replay.readers import ReplayBodyReader, ReplayStreamReader
from loadtest.replay.run import build_request, input_items
from serving.frontend.errors import APIError
from serving.frontend.http.routes.openai_api import Front
from serving.frontend.http.routes.openai_requests import decode_body
from serving.frontend.http.routes.responses_input import responses_error, responses_input, to_messages
from serving.frontend.http.routes.responses_requests import ResponsesRequest
from serving.frontend.http.routes.responses_shapes import EventStream, ResponseObject
from serving.frontend.http.routes.responses_store import ResponseStore, StoredResponse
from serving.frontend.output_parsing import ParsingConfig
from telemetry.metrics import Metrics
from telemetry.request_record import RequestRecord

FRONT = Front("m", parsing=ParsingConfig(tool_parser="hermes"))
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def build(previous: StoredResponse | None = None, **body):
    req = decode_body(json.dumps({"input": "hi", **body}).encode(), ResponsesRequest)
    return responses_input(req, FRONT, previous)


def refusal(**body) -> APIError:
    with pytest.raises(APIError) as exc:
        build(**body)
    return responses_error(exc.value)


def test_fields_map_to_the_chat_request():
    obj, turn = build(
        instructions="Be brief.",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    assert obj.messages[0] == {"role": "system", "content": "Be brief."}
    assert obj.messages[1:] == turn.messages == [{"role": "user", "content": "hi"}]  # instructions not kept
    assert (obj.max_new_tokens, obj.sampling.temperature, obj.sampling.top_p) == (7, 0.5, 0.9)
    assert obj.param_names == {"max_new_tokens": "max_output_tokens"}
    assert obj.template.tools[0]["function"]["name"] == "get_weather" and obj.sampling.structured.kind == "grammar"
    assert [c.param for c in obj.constraints] == ["tools[0].parameters", "tools"]
    assert turn.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert not turn.echo["parallel_tool_calls"]


def test_text_format_is_the_response_format_constraint_under_its_own_name():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    obj, turn = build(text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})
    assert obj.sampling.structured.kind == "json_schema" and json.loads(obj.sampling.structured.spec)["properties"]
    assert [c.param for c in obj.constraints] == ["text.format.schema"]
    assert turn.echo["text"] == {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}


def test_items_become_one_assistant_message_per_turn_and_tool_answers_name_their_function():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ]
    obj, turn = build(input=items)
    assert [m["role"] for m in turn.messages] == ["user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in turn.messages[1]["tool_calls"]] == ["c1", "c2"]
    assert turn.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"}
    assert obj.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # as templates read it
    assert all(item["id"] for item in turn.items)


def test_a_previous_response_is_the_context_of_the_next_turn():
    names: dict[str, str] = {}
    history = to_messages(
        [
            {"type": "message", "role": "user", "content": "I am Ada."},
            {"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"},
        ],
        names,
    )
    previous = StoredResponse({"id": "resp_1"}, [], history, names)
    obj, turn = build(
        previous, input=[{"type": "function_call_output", "call_id": "c9", "output": "done"}], instructions="New rules."
    )
    assert obj.messages[0]["content"] == "New rules." and turn.messages[:2] == history
    assert [m["role"] for m in obj.messages] == ["system", "user", "assistant", "tool"]
    assert turn.messages[-1] == {"role": "tool", "tool_call_id": "c9", "content": "done", "name": "f"}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_refusals_name_the_responses_field(body, param):
    err = refusal(**body)
    assert err.status == 400 and err.param == param, err.message
    assert "messages" not in err.message and "max_completion_tokens" not in err.message


def chunk(delta: dict | None = None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def run_stream(chunks: list[dict]) -> tuple[list[dict], EventStream]:
    stream = EventStream(ResponseObject("r1", "m", build()[1].echo))
    events = stream.start()
    for c in chunks:
        events += stream.chunk(c)
    events += stream.end()
    for ev in events:
        EVENTS.validate_python(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    return events, stream


def test_text_then_calls_stream_as_items_one_after_another():
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 9,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    events, stream = run_stream(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Let me "}),
            chunk({"content": "check."}),
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                }
            ),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]}, "tool_calls"),
            {"choices": [], "usage": usage, "sightline": {"ttft_ms": 1.0}},
        ]
    )
    kinds = [ev["type"] for ev in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(stream.final)
    assert final.output_text == "Let me check." and final.output[1].arguments == '{"city": "Oslo"}'
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.input_tokens_details.cached_tokens) == (
        5,
        9,
        2,
    )
    assert stream.final["sightline"] == {"ttft_ms": 1.0}


def test_a_cut_stream_is_incomplete_and_an_engine_error_fails_it():
    events, stream = run_stream([chunk({"content": "abc"}, "length")])
    assert (
        events[-1]["type"] == "response.incomplete"
        and stream.final["incomplete_details"]["reason"] == "max_output_tokens"
    )
    events, _ = run_stream([])  # nothing generated: still one empty message
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    failed = EventStream(ResponseObject("r2", "m", {})).chunk({"error": {"message": "boom", "type": "internal_error"}})
    assert [ev["type"] for ev in failed] == ["error", "response.failed"]
    assert failed[1]["response"]["error"] == {"code": "server_error", "message": "boom"}


def test_the_store_evicts_the_least_recently_used_and_counts_it():
    metrics = Metrics("m")
    store = ResponseStore(2, metrics)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, [], []))
    store.get("a")  # used: b is now the oldest
    store.put("c", StoredResponse({"id": "c"}, [], []))
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert metrics.responses_evicted._value.get() == 1 and metrics.responses_stored._value.get() == 2
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    off = ResponseStore(0)
    off.put("x", StoredResponse({}, [], []))
    assert off.get("x") is None


def test_a_record_replays_as_a_responses_body():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
    ]
    rec = RequestRecord(
        arrival=0.0,
        rid="r",
        route="/v1/responses",
        operation="chat",
        model="m",
        stream=True,
        params={"temperature": 0.0, "max_new_tokens": 9},
        completion_tokens=4,
        outcome="length",
    )
    path, body = build_request(rec, messages, "m")
    assert path == "/v1/responses" and body["max_output_tokens"] == 4 and body["ignore_eos"] and not body["store"]
    assert body["input"] == input_items(messages) and "stream_options" not in body
    assert body["input"][2] == {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
    assert body["input"][3] == {"type": "function_call_output", "call_id": "c1", "output": "out"}
    req = decode_body(json.dumps(body).encode(), ResponsesRequest)  # the server takes it as sent
    obj, _ = responses_input(req, Front("m", allow_unknown=False), None)
    assert [m["role"] for m in obj.messages] == ["system", "user", "assistant", "tool"]


def test_the_replay_readers_read_a_responses_stream_and_body():
    events, stream = run_stream(
        [
            chunk({"content": "Hi"}, "stop"),
            {
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                "sightline": {"e2e_ms": 5.0},
            },
        ]
    )
    reader = ReplayStreamReader(ClientRecord("w", "responses", 0, 0.0, 0.0, 0.0), 0.0)
    reader.feed(b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events), 0.5)
    rec = reader.finish(1.0)
    assert (rec.error, rec.finish_reason, rec.prompt_tokens, rec.completion_tokens) == (None, "stop", 3, 1)
    assert rec.ttft == 0.5 and reader.server == {"e2e_ms": 5.0}
    body = ReplayBodyReader(ClientRecord("w", "responses", 0, 0.0, 0.0, 0.0), 0.0)
    body.feed(json.dumps(stream.final).encode(), 0.5)
    got = body.finish(1.0)
    assert (got.error, got.finish_reason, got.prompt_tokens, got.completion_tokens) == (None, "stop", 3, 1)


def test_reasoning_is_its_own_item_streamed_or_whole():
    events, stream = run_stream(
        [
            chunk({"reasoning_content": "Think"}),
            chunk({"reasoning_content": "ing."}),
            chunk({"content": "Done."}, "stop"),
        ]
    )
    assert [ev["type"] for ev in events][2:5] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
    ]
    assert [item["type"] for item in stream.final["output"]] == ["reasoning", "message"]
    assert stream.final["output"][0]["content"][0]["text"] == "Thinking."
    whole = ResponseObject("r3", "m", build()[1].echo).from_chat(
        {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "Hm.",
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {
                "prompt_tokens": 4,
                "completion_tokens": 6,
                "total_tokens": 10,
                "completion_tokens_details": {"reasoning_tokens": 2},
            },
        }
    )
    parsed = Response.model_validate(whole)
    assert [item.type for item in parsed.output] == ["reasoning", "function_call"] and parsed.status == "completed"
    assert parsed.usage.output_tokens_details.reasoning_tokens == 2 and parsed.output[1].call_id == "c1"
