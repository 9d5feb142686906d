"""Tool calling and reasoning against real servers, through the `openai` client: a seeded qwen2-family
model served with a Hermes-style template (tests/fixtures/chat_templates/hermes_tools.jinja, the
parser picked by `--tool-call-parser auto`), and a seeded llama-family model with a Llama-3.1-JSON
template (llama3_json_tools.jinja) and `--reasoning-parser deepseek_r1`.

The seeded models write noise, so a call only happens when a grammar forces it: the tests named
`test_forced_*` and `test_a_call_that_does_not_parse_*` need the engine to honour
`SamplingParams.structured` (llguidance token masks in the Scheduler).  The rest (rendering, second
turns, free answers, reasoning, refusals) hold without it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.family_models import build
from tests.server_util import ServerProc, scrape, value

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "now": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the llama server thinks by default
SERVERS = {
    "qwen2": ("hermes_tools.jinja", "hermes"),
    "llama": ("llama3_json_tools.jinja", "llama3_json"),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers, started side by side (paths and tmp dirs made here: neither transformers' lazy imports nor
    tmp_path_factory are thread-safe)."""
    dumps = tmp_path_factory.mktemp("dumps")
    paths = {f: str(build(f)) for f in SERVERS}
    dirs = {f: tmp_path_factory.mktemp(f) for f in SERVERS}

    def start(family: str) -> ServerProc:
        flags = [
            "--num-threads",
            "1",
            "--served-model-name",
            "m",
            "--chat-template",
            str(TEMPLATES / SERVERS[family][0]),
        ]
        flags += (
            ["--reasoning-parser", "deepseek_r1"]
            if family == "llama"
            else ["--dump-requests", str(dumps), "--dump-content"]
        )
        return ServerProc(*flags, model=paths[family], tmpdir=dirs[family])

    with ThreadPoolExecutor(len(SERVERS)) as pool:
        futures = {f: pool.submit(start, f) for f in SERVERS}
    started = {f: fut.result() for f, fut in futures.items() if fut.exception() is None}
    try:
        for fut in futures.values():
            if fut.exception() is not None:
                raise fut.exception()
        started["qwen2"].dumps = dumps
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def client(srv: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def extra(family: str) -> dict:
    return {"extra_body": NO_THINKING} if family == "llama" else {}


@pytest.mark.parametrize("family", SERVERS)
def test_auto_detection_and_the_tools_in_the_prompt(servers, family):
    srv = servers[family]
    assert f"tool-call parser: {SERVERS[family][1]} (--tool-call-parser auto" in srv.log()
    kwargs = NO_THINKING if family == "llama" else {}
    bare = srv.post("/tokenize", {"messages": ASK, **kwargs}).json()["count"]
    with_tools = srv.post("/tokenize", {"messages": ASK, "tools": TOOLS, **kwargs}).json()
    assert with_tools["count"] > bare + 30
    text = srv.post("/detokenize", {"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text
    answer = client(srv).chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2, **extra(family)
    )
    assert answer.usage.prompt_tokens == with_tools["count"]


@pytest.mark.parametrize("family", SERVERS)
def test_a_free_answer_is_content(servers, family):
    """tool_choice auto: the model is free, its noise is no call, and comes back as content."""
    c = client(servers[family])
    whole = c.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0, **extra(family)
    )
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    chunks = list(
        c.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0, stream=True, **extra(family)
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.parametrize("family", SERVERS)
def test_a_second_turn_with_the_tool_result_renders_and_runs(servers, family):
    srv = servers[family]
    turn = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    answer = client(srv).chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=4, **extra(family))
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = srv.post("/tokenize", {"messages": turn, "tools": TOOLS}).json()["tokens"]
    prompt = srv.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert '{"forecast": "sunny"}' in prompt and '"city": "Paris"' in prompt


def _streamed_calls(chunks) -> tuple[dict[int, list[str]], str | None]:
    """Calls by index ([name, concatenated arguments]) from OpenAI stream deltas, and the finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d  # the first delta of a call
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None, d
                calls[d.index][1] += d.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("family", SERVERS)
def test_forced_required_call_streams_arguments_in_pieces(servers, family):
    c = client(servers[family])
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0.8, seed=3, **extra(family))
    ceiling = 120  # long: a ceiling only: the grammar ends the call well before it
    chunks = list(c.chat.completions.create(model="m", messages=ASK, max_tokens=ceiling, stream=True, **kw))
    calls, finish = _streamed_calls(chunks)
    assert finish == "tool_calls" and calls, chunks
    for name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    whole = c.chat.completions.create(model="m", messages=ASK, max_tokens=ceiling, **kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [[t.function.name, t.function.arguments] for t in whole.choices[0].message.tool_calls] == [
        calls[i] for i in sorted(calls)
    ]


@pytest.mark.parametrize("family", SERVERS)
def test_forced_named_call_is_that_tool_once(servers, family):
    answer = client(servers[family]).chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=120,  # long: a ceiling: the grammar ends it
        temperature=0.8,
        seed=5,
        **extra(family),
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_a_call_that_does_not_parse_is_content_counted_and_recorded(servers):
    """A regex forces half a call (then the end): the answer is its text, the failure is counted by parser, and
    the flight recorder (--dump-content) keeps the text."""
    srv = servers["qwen2"]
    before = value(scrape(srv), "sightline_tool_call_parse_failures_total", parser="hermes")
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    r = srv.post(
        "/v1/chat/completions",
        {
            "messages": ASK,
            "tools": TOOLS,
            "max_tokens": 40,
            "structured_outputs": {"regex": broken.replace("{", r"\{")},
        },
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == broken, choice
    assert "tool_calls" not in choice["message"]
    assert value(scrape(srv), "sightline_tool_call_parse_failures_total", parser="hermes") == before + 1
    records = [json.loads(line) for f in srv.dumps.glob("requests-*.jsonl") for line in f.read_text().splitlines()]
    assert any(rec.get("tool_call_parse_failed") == "hermes" and rec.get("tool_call_text") == broken for rec in records)


def test_deepseek_r1_reasoning_and_thinking_turned_off(servers):
    srv = servers["llama"]
    c = client(srv)
    thought = c.chat.completions.create(model="m", messages=ASK, max_tokens=6, temperature=0)
    msg = thought.choices[0].message
    assert msg.content is None and msg.reasoning_content  # noise that never closed </think>: all reasoning
    details = thought.usage.completion_tokens_details
    assert details.reasoning_tokens == thought.usage.completion_tokens == 6
    chunks = list(
        c.chat.completions.create(
            model="m", messages=ASK, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert (
        "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
        == msg.reasoning_content
    )
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 6
    plain = c.chat.completions.create(model="m", messages=ASK, max_tokens=6, temperature=0, extra_body=NO_THINKING)
    assert plain.choices[0].message.content and plain.choices[0].message.reasoning_content is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(servers, body, param):
    srv = servers["qwen2"]
    r = srv.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
