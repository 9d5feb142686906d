"""Drive a running server with a real client library, as its users would: one scenario, or several in a row.

Run with the clients' own interpreter (.venv-clients/bin/python, tests/clients/requirements.txt):
    drive.py SCENARIO BASE_URL     one scenario, one JSON line out
    drive.py --serve               one {"scenario", "base_url", "env"} line in, one JSON line out, until EOF
                                   (tests/client_venv.py: the libraries imported once for a whole test run)
Each JSON object is what the client returned (the validated object's fields, the tool calls made, the
requests' shapes), for tests/e2e/test_structured_clients.py and test_messages_api.py to check.
Nothing here fakes the server or patches the client; the only settings are the base URL, the anthropic
SDK's key (ANTHROPIC_API_KEY, as its users set it) and, for the Agents SDK, tracing off (it would export to
OpenAI's servers).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Literal

from pydantic import BaseModel, Field

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


class Color(BaseModel):
    """The Responses stream helper's `text_format`: the grammar ends the answer, so the response completes."""

    color: Literal["red", "green", "blue"]


class City(BaseModel):
    """What every scenario extracts: small enough for a 135M model, bounded so the grammar ends early."""

    name: str = Field(max_length=24)
    country: Literal["France", "Japan", "Peru"]
    population_millions: int = Field(ge=0, le=50)


PROMPT = "Paris is the capital of France and has about 2 million people. Extract the city."


def _openai(base_url: str):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)


def _model(client) -> str:
    return client.models.list().data[0].id


def openai_parse(base_url: str) -> dict:
    """openai's `.parse()`: response_format from a Pydantic model (json_schema, strict), parsed back."""
    client = _openai(base_url)
    out = client.chat.completions.parse(
        model=_model(client),
        messages=[{"role": "user", "content": PROMPT}],
        response_format=City,
        max_tokens=64,
        temperature=0,
    )
    msg = out.choices[0].message
    return {
        "parsed": msg.parsed.model_dump(),
        "type": type(msg.parsed).__name__,
        "finish_reason": out.choices[0].finish_reason,
    }


def _instructor(base_url: str, mode_name: str, **extra) -> dict:
    import instructor

    client = _openai(base_url)
    model = _model(client)
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode_name))
    city = patched.chat.completions.create(
        model=model,
        response_model=City,
        max_retries=0,
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": PROMPT}],
        **extra,
    )
    return {"parsed": city.model_dump(), "type": type(city).__name__}


def instructor_tools(base_url: str) -> dict:
    return _instructor(base_url, "TOOLS")


def instructor_json(base_url: str) -> dict:
    """JSON mode sends response_format json_object, which forces *an* object; the schema goes in extra_body as
    structured_outputs.json, as instructor's JSON mode is used against vLLM, and says which object."""
    return _instructor(base_url, "JSON", extra_body={"structured_outputs": {"json": City.model_json_schema()}})


def instructor_json_schema(base_url: str) -> dict:
    return _instructor(base_url, "JSON_SCHEMA")


def _langchain(base_url: str, method: str) -> dict:
    from langchain_openai import ChatOpenAI

    model = _model(_openai(base_url))
    llm = ChatOpenAI(base_url=base_url, api_key="none", model=model, temperature=0, max_tokens=64, max_retries=0)
    city = llm.with_structured_output(City, method=method).invoke(PROMPT)
    return {"parsed": city.model_dump(), "type": type(city).__name__}


def langchain_json_schema(base_url: str) -> dict:
    return _langchain(base_url, "json_schema")


def langchain_function_calling(base_url: str) -> dict:
    return _langchain(base_url, "function_calling")


def _population_tool():
    """The agents' function tool, and the list of the calls it got."""
    from agents import function_tool

    calls: list[dict] = []

    @function_tool
    def lookup_population(city: str, year: int) -> str:
        """The population of a city in a given year."""
        calls.append({"city": city, "year": year})
        return f"{city} had 2.1 million people in {year}."

    return lookup_population, calls


def agents_tool_turn(base_url: str) -> dict:
    """The Agents SDK on chat completions: one function tool, tool_choice required; the tool runs and its result
    goes back to the model in the next turn (the SDK resets tool_choice after a call, so that turn may answer)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    lookup_population, calls = _population_tool()

    async def run() -> dict:
        client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
        model_id = (await client.models.list()).data[0].id
        agent = Agent(
            name="assistant",
            instructions="Use the tool to answer.",
            tools=[lookup_population],
            model=OpenAIChatCompletionsModel(model=model_id, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
        )
        result = await Runner.run(agent, "How many people lived in Paris in 2020?", max_turns=4)
        items = [type(i).__name__ for i in result.new_items]
        return {"calls": calls, "items": items, "final_output": str(result.final_output)}

    return asyncio.run(run())


# -- the anthropic SDK on /v1/messages (BASE_URL is the server's root; the key is ANTHROPIC_API_KEY, sent as
# x-api-key) --------------------------------------------------------------------------------------------
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # this SDK dropped its sampling arguments; the API (and the server) still take them
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}


def _anthropic(base_url: str):
    """The client and the served model's id (its models.list reads /v1/models' `data[].id`)."""
    from anthropic import Anthropic

    client = Anthropic(base_url=base_url.removesuffix("/v1"), max_retries=0, timeout=60)
    return client, client.models.list().data[0].id


def _message(msg) -> dict:
    """What a test checks of a Message: its text, blocks, stop and usage."""
    return {
        "id": msg.id,
        "model": msg.model,
        "text": "".join(b.text for b in msg.content if b.type == "text"),
        "types": [b.type for b in msg.content],
        "stop_reason": msg.stop_reason,
        "stop_sequence": msg.stop_sequence,
        "usage": msg.usage.model_dump(exclude_none=True),
    }


def anthropic_create(base_url: str) -> dict:
    """messages.create, then the same request with a stop sequence taken from its answer (greedy: the same
    tokens until there)."""
    client, model = _anthropic(base_url)
    ask = {
        "model": model,
        "max_tokens": 12,
        "extra_body": GREEDY,
        "system": "Answer in one short sentence.",
        "messages": [{"role": "user", "content": QUESTION}],
    }
    first = _message(client.messages.create(**ask))
    words = first["text"].split()
    stop = words[1] if len(words) > 1 else words[0]
    return {"first": first, "stop": stop, "stopped": _message(client.messages.create(**ask, stop_sequences=[stop]))}


def anthropic_stream(base_url: str) -> dict:
    """messages.stream: the text as it streams (text_stream), then the final message the SDK accumulated."""
    client, model = _anthropic(base_url)
    with client.messages.stream(
        model=model, max_tokens=10, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    return {"pieces": pieces, "final": _message(final)}


def anthropic_tool_round_trip(base_url: str) -> dict:
    """A forced tool call (tool_choice {type: tool}), its result sent back as a tool_result block, the answer."""
    client, model = _anthropic(base_url)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(
        model=model,
        max_tokens=32,
        extra_body=GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=messages,
    )
    calls = [b for b in first.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "Sunny and 21 degrees."} for c in calls]
    second = client.messages.create(
        model=model,
        max_tokens=12,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[*messages, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}],
    )
    return {
        "first": _message(first),
        "calls": [{"id": c.id, "name": c.name, "input": c.input} for c in calls],
        "second": _message(second),
    }


def anthropic_count_tokens(base_url: str) -> dict:
    """messages.count_tokens, and the input usage of the same prompt answered."""
    client, model = _anthropic(base_url)
    ask = {"model": model, "system": "Be brief.", "messages": [{"role": "user", "content": QUESTION}]}
    counted = client.messages.count_tokens(**ask)
    answered = client.messages.create(**ask, max_tokens=2)
    return {"counted": counted.input_tokens, "usage": answered.usage.model_dump(exclude_none=True)}


def anthropic_types(base_url: str) -> dict:
    """The server's raw bodies and every streamed event validated against the SDK's own pydantic types (the
    SDK builds its objects without validating)."""
    import httpx
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    url, model = base_url.removesuffix("/v1") + "/v1/messages", _anthropic(base_url)[1]
    headers = {"x-api-key": os.environ.get("ANTHROPIC_API_KEY", ""), "anthropic-version": "2023-06-01"}
    plain = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}
    tool = {**plain, "max_tokens": 32, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    types = []
    for body in (plain, tool):
        answer = Message.model_validate(httpx.post(url, json=body, headers=headers, timeout=60).json())
        types.append([b.type for b in answer.content])
    adapter, names = TypeAdapter(RawMessageStreamEvent), []
    for body in (plain, tool):
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: ") and name != "ping":
                    event = adapter.validate_python(json.loads(line[6:]))
                    assert event.type == name, (event.type, name)
                    names.append(name)
    return {"events": names, "types": types}


def _usage(usage) -> dict:
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
    }


def responses_turns(base_url: str) -> dict:
    """`responses.create` twice, the second continuing the first by `previous_response_id`, and the second
    turn's input alone for comparison; each response retrieved back by id."""
    client = _openai(base_url)
    model = _model(client)
    first = client.responses.create(
        model=model, input="My name is Ada and I live in Paris.", max_output_tokens=12, temperature=0
    )
    follow = client.responses.create(
        model=model,
        input="Which city do I live in?",
        max_output_tokens=12,
        temperature=0,
        previous_response_id=first.id,
    )
    alone = client.responses.create(
        model=model, input="Which city do I live in?", max_output_tokens=12, temperature=0, store=False
    )
    back = client.responses.retrieve(follow.id)
    return {
        "turns": [
            {"id": r.id, "text": r.output_text, "status": r.status, "usage": _usage(r.usage)}
            for r in (first, follow, alone)
        ],
        "retrieved": {"id": back.id, "text": back.output_text, "previous": back.previous_response_id},
    }


def responses_streams(base_url: str) -> dict:
    """A streamed create two ways: iterating `stream=True`, and the `responses.stream` helper's final response."""
    client = _openai(base_url)
    model = _model(client)
    kinds, deltas, final = [], [], None
    for event in client.responses.create(
        model=model, input="Name a color.", max_output_tokens=8, temperature=0, stream=True
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    with client.responses.stream(
        model=model,
        input="The sky is blue. What color is the sky?",
        text_format=Color,
        max_output_tokens=32,
        temperature=0,
    ) as s:
        helper = s.get_final_response()
    return {
        "kinds": kinds,
        "text": "".join(deltas),
        "final_text": final.output_text,
        "usage": _usage(final.usage),
        "helper": {
            "text": helper.output_text,
            "status": helper.status,
            "usage": _usage(helper.usage),
            "parsed": helper.output_parsed.model_dump(),
            "type": type(helper.output_parsed).__name__,
        },
    }


def _agents_default(base_url: str):
    """The Agents SDK with its default model class (OpenAIResponsesModel) on this server."""
    from agents import set_default_openai_api, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    set_default_openai_client(client, use_for_tracing=False)
    set_default_openai_api("responses")
    return client


def _run_result(result) -> dict:
    usage = result.context_wrapper.usage
    return {
        "final_output": str(result.final_output),
        "items": [type(i).__name__ for i in result.new_items],
        "response_ids": [r.response_id for r in result.raw_responses],
        "usage": {"requests": usage.requests, "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
    }


def agents_responses_turn(base_url: str) -> dict:
    """One turn of an agent whose model is only named: the SDK's default provider resolves it to
    OpenAIResponsesModel, whose responses carry `resp_` ids (a chat-completions model's carry none)."""
    from agents import Agent, ModelSettings, Runner
    from agents.models.multi_provider import MultiProvider

    async def run() -> dict:
        client = _agents_default(base_url)
        model_id = (await client.models.list()).data[0].id
        agent = Agent(
            name="assistant",
            instructions="Answer in one short sentence.",
            model=model_id,
            model_settings=ModelSettings(max_tokens=16, temperature=0),
        )
        result = await Runner.run(agent, "What is the capital of France?", max_turns=1)
        return {**_run_result(result), "model_class": type(MultiProvider().get_model(model_id)).__name__}

    return asyncio.run(run())


def agents_responses_tool_turn(base_url: str) -> dict:
    """The default (Responses) model with one function tool: the call, its output sent back, then an answer."""
    from agents import Agent, ModelSettings, Runner

    lookup_population, calls = _population_tool()

    async def run() -> dict:
        client = _agents_default(base_url)
        model_id = (await client.models.list()).data[0].id
        agent = Agent(
            name="assistant",
            instructions="Use the tool to answer.",
            tools=[lookup_population],
            model=model_id,
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=48, temperature=0
            ),
        )
        result = await Runner.run(agent, "How many people lived in Paris in 2020?", max_turns=4)
        return {**_run_result(result), "calls": calls}

    return asyncio.run(run())


SCENARIOS = {
    f.__name__: f
    for f in (
        openai_parse,
        instructor_tools,
        instructor_json,
        instructor_json_schema,
        langchain_json_schema,
        langchain_function_calling,
        agents_tool_turn,
        anthropic_create,
        anthropic_stream,
        anthropic_tool_round_trip,
        anthropic_count_tokens,
        anthropic_types,
        responses_turns,
        responses_streams,
        agents_responses_turn,
        agents_responses_tool_turn,
    )
}


def run(name: str, base_url: str, env: dict[str, str] | None = None) -> dict:
    """One scenario, with `env` set for it alone (the key a client reads when it is constructed)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return {"ok": True, **SCENARIOS[name](base_url)}
    except Exception as e:  # noqa: BLE001 - the test reads what failed, with the client's own words
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def main() -> None:
    if sys.argv[1] == "--serve":  # one JSON request a line on stdin, one JSON answer a line on stdout
        for line in sys.stdin:
            ask = json.loads(line)
            print(json.dumps(run(ask["scenario"], ask["base_url"], ask.get("env")), default=str), flush=True)
        return
    print(json.dumps(run(sys.argv[1], sys.argv[2]), default=str))


if __name__ == "__main__":
    main()
