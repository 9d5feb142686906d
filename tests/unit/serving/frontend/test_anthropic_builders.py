"""The Messages API without a server: an Anthropic body → the chat request the chat route builds (turns,
tool blocks, tools and tool_choice, sampling), what is refused and how it is named, and the answer's
shapes (stop reasons, usage, the event sequence of a streamed text and tool call)."""

from __future__ import annotations

import json

import pytest

from serving.frontend.errors import APIError, anthropic_body, anthropic_route, refusal_for
from serving.frontend.http.routes.anthropic_api import count_input, messages_input
from serving.frontend.http.routes.anthropic_requests import CountTokensRequest, MessagesRequest
from serving.frontend.http.routes.anthropic_shapes import MessageShape, content, stop_reason, usage
from serving.frontend.http.routes.openai_api import Front
from serving.frontend.http.routes.openai_requests import decode_body
from serving.frontend.output_parsing import ParsedAnswer, ParsingConfig

FRONT = Front("m", parsing=ParsingConfig(tool_parser="hermes"))
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "now",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def build(**body):
    raw = json.dumps({"model": "m", "max_tokens": 8, "messages": USER, **body}).encode()
    return messages_input(decode_body(raw, MessagesRequest), FRONT)


def refused(status: int = 400, **body) -> str:
    with pytest.raises(APIError) as exc:
        build(**body)
    assert exc.value.status == status
    return exc.value.message


def test_system_turns_and_sampling_map_to_the_chat_request():
    obj = build(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_sequences=["END"],
        metadata={"user_id": "u-1"},
        stream=True,
        seed=7,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
        ],
    )
    assert obj.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    sp = obj.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, obj.stop, obj.user, obj.stream) == (0.5, 0.9, 20, ["END"], "u-1", True)
    assert sp.seed == 7 and obj.max_new_tokens == 8
    assert obj.template.add_generation_prompt and not obj.template.continue_final_message


def test_a_final_assistant_turn_is_continued_and_an_empty_one_dropped():
    obj = build(messages=[*USER, {"role": "assistant", "content": "The answer is"}])
    assert obj.template.continue_final_message and not obj.template.add_generation_prompt
    assert obj.messages[-1] == {"role": "assistant", "content": "The answer is"}
    obj = build(messages=[*USER, {"role": "assistant", "content": ""}])
    assert obj.messages == USER and obj.template.add_generation_prompt


def test_tool_use_and_tool_result_blocks_render_as_the_chat_route_renders_tool_calls():
    obj = build(
        tools=[WEATHER],
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Sunny"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assistant, tool, user = obj.messages[1:]
    assert assistant == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "look it up",
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    assert tool == {"role": "tool", "content": "Sunny", "tool_call_id": "t1"}
    assert user == {"role": "user", "content": "And tomorrow?"}
    assert obj.template.tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "now", "parameters": WEATHER["input_schema"]},
        }
    ]


@pytest.mark.parametrize(
    "choice, forced, calls",
    [
        ({"type": "auto"}, False, None),
        ({"type": "any"}, True, None),
        ({"type": "tool", "name": "get_weather"}, True, 1),
        ({"type": "any", "disable_parallel_tool_use": True}, True, 1),
    ],
)
def test_tool_choice_maps_to_the_chat_route_tool_choice(choice, forced, calls):
    obj = build(tools=[WEATHER], tool_choice=choice)
    assert obj.parsing is not None and obj.parsing.max_calls == calls
    assert (obj.sampling.structured is not None) == forced
    assert build(tools=[WEATHER], tool_choice={"type": "none"}).parsing is None


def test_output_config_format_is_the_structured_output():
    obj = build(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert obj.sampling.structured.kind == "json_schema"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"messages": [{"role": "assistant", "content": "x"}, *USER]}, 400, "first message must be a user turn"),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "unexpected role 'system'"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "type 'image'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
            400,
            "tool_use blocks belong in assistant turns",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
            400,
            "not a tool_use id",
        ),
        ({"messages": [{"role": "user", "content": ""}, *USER]}, 400, "non-empty content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, 400, "must be non-empty"),
        ({"messages": []}, 400, "at least one message"),
        ({"model": "claude-sonnet"}, 404, "claude-sonnet"),
        ({"max_tokens": 0}, 400, "max_tokens: must be >= 1"),
        ({"temperature": 1.5}, 400, "temperature"),
        ({"stop_sequences": [""]}, 400, "stop_sequences"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
        ({"tools": [{"name": "x"}]}, 400, "tools[0].input_schema"),
        ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, 400, "tools[0].input_schema must be"),
        ({"tools": [{**WEATHER, "name": "a b"}]}, 400, "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, 400, "'other'"),
        ({"tool_choice": {"type": "whatever"}}, 400, "tool_choice"),
        ({"output_config": {"effort": "high"}}, 400, "output_config.effort"),
        ({"container": "c"}, 400, "container"),
        ({"frequency_penalty": 1}, 400, "unknown parameter `frequency_penalty`"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body, status, words):
    assert words in refused(status, **body)


def test_a_missing_max_tokens_is_refused_by_the_decoder_and_count_tokens_needs_none():
    with pytest.raises(APIError) as exc:
        decode_body(json.dumps({"model": "m", "messages": USER}).encode(), MessagesRequest)
    assert "max_tokens" in exc.value.message
    obj = count_input(
        decode_body(json.dumps({"model": "m", "messages": USER, "system": "s"}).encode(), CountTokensRequest), FRONT
    )
    assert obj.messages[0] == {"role": "system", "content": "s"}


def test_errors_are_in_anthropic_shape_on_its_paths_only():
    assert anthropic_route("/v1/messages") and anthropic_route("/v1/messages/count_tokens")
    assert not anthropic_route("/v1/chat/completions")
    assert anthropic_body(429, "slow down") == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert anthropic_body(500, "x")["error"]["type"] == "api_error"
    openai = json.dumps({"error": {"message": "no key", "type": "invalid_request_error"}}).encode()
    assert json.loads(refusal_for("/v1/messages", 401, openai)) == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no key"},
    }
    assert refusal_for("/v1/completions", 401, openai) == openai


def test_stop_reasons_and_usage():
    assert stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, ["END"]) == ("end_turn", None)
    assert stop_reason("length", None, []) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, []) == ("tool_use", None)
    assert usage(30, 24, 5) == {
        "input_tokens": 6,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 24,
    }
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert content("", ParsedAnswer(None, None, [call])) == [
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}
    ]
    assert content("hi", None) == [{"type": "text", "text": "hi"}]


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in raw.decode().strip().split("\n\n"):
        name, data = chunk.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_stream_opens_grows_and_closes_one_block_at_a_time():
    shape = MessageShape("msg_1", "m", [])
    raw = (
        shape.start(usage(3, 0, 0))
        + shape.delta({"content": "Let me check."})
        + shape.delta(
            {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}
        )
        + shape.delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]})
        + shape.delta(
            {"tool_calls": [{"index": 1, "id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
        )
        + shape.finish("tool_use", None, usage(3, 0, 9), {"e2e_ms": 1.0})
    )
    events = _events(raw)
    assert [n for n, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(d["type"] == n for n, d in events)
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and end["usage"]["output_tokens"] == 9
    empty = _events(MessageShape("msg_2", "m", []).finish("end_turn", None, usage(1, 0, 1), None))
    assert [n for n, _ in empty][:2] == ["content_block_start", "content_block_stop"]
