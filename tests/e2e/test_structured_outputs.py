"""Structured outputs against one real tiny-random server: every bad constraint is a 400 naming its
field (and the kind of error), costs the engine nothing (the Scheduler's step and prefill counters do
not move), and leaves the server serving; good ones shape the answer.

The tests named `test_engine_*` need the engine to honour `SamplingParams.structured` (llguidance
masks in the Scheduler); the rest hold with the front end alone.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from protocol.sampling_params import MAX_GRAMMAR_BYTES
from tests.server_util import ServerProc, scrape, sse_events, value

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Give me a record."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "rank"],
    "additionalProperties": False,
}
HUGE = {"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}
BAD = [  # (route, the constraint fields, the param named, the error code)
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "strnig"}}}},
        "response_format.json_schema.schema",
        "invalid_schema",
    ),  # not a JSON Schema (meta-schema)
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "c",
                    "schema": {"type": "string", "pattern": "^((a{50}){50}){50}$", "minLength": 5},
                },
            }
        },
        "response_format.json_schema.schema",
        "invalid_schema",
    ),  # a schema llguidance cannot compile
    (COMP, {"structured_outputs": {"json": HUGE}}, "structured_outputs.json", "invalid_schema"),  # over 256 KiB
    (
        CHAT,
        {"structured_outputs": {"regex": "(.{1,100}){1,100}z"}},
        "structured_outputs.regex",
        "invalid_grammar",
    ),  # its lexer explodes: caught with the tokenizer, at the first mask
    (COMP, {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "invalid_grammar"),
    (
        CHAT,
        {"structured_outputs": {"grammar": "start: undefined_rule"}},
        "structured_outputs.grammar",
        "invalid_grammar",
    ),
    (COMP, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "invalid_grammar"),
    (
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
        "structured_outputs.regex",
        "conflicting_constraints",
    ),
    (
        COMP,
        {"structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}},
        "structured_outputs.choice",
        "conflicting_constraints",
    ),
    *(
        (CHAT if i % 2 else COMP, {name: v}, name, "unsupported_parameter")
        for i, (name, v) in enumerate(
            (
                ("guided_json", {"type": "object"}),
                ("guided_regex", "a+"),
                ("guided_choice", ["a"]),
                ("guided_grammar", 'start: "a"'),
                ("guided_decoding_backend", "xgrammar"),
                ("guided_whitespace_pattern", " "),
            )
        )
    ),
]


@pytest.fixture(scope="module")
def srv(server):
    """The module's own tiny-random server (tests/conftest.py): the Scheduler counters must see only this traffic."""
    return server


def base(path: str) -> dict:
    return {"messages": MSGS} if path == CHAT else {"prompt": "A record:"}


def engine_work(srv: ServerProc) -> tuple[float, float]:
    srv.barrier()  # the Scheduler's latest stats are in
    text = scrape(srv)
    return (value(text, "sightline_scheduler_steps_total"), value(text, "sightline_scheduler_prefill_tokens_total"))


@pytest.mark.parametrize("path,fields,param,code", BAD, ids=[f"{p}-{c}" for _, _, p, c in BAD])
def test_a_bad_constraint_is_a_400_naming_its_field_and_costs_the_scheduler_nothing(srv, path, fields, param, code):
    before = engine_work(srv)
    rejected = value(scrape(srv), "sightline_requests_total", status="400", outcome="rejected")
    r = srv.post(path, {**base(path), "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    if param.startswith("guided_"):
        assert "structured_outputs" in err["message"]
    assert engine_work(srv) == before  # no request reached the Scheduler
    assert value(scrape(srv), "sightline_requests_total", status="400", outcome="rejected") == rejected + 1


def test_still_serving_after_the_refusals(srv):
    r = srv.post(COMP, {"prompt": "A record:", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_good_constraints_are_accepted_and_text_means_none(srv):
    for fields in (
        {"response_format": {"type": "text"}},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json": json.dumps(CITY), "disable_any_whitespace": True}},
    ):
        r = srv.post(CHAT, {"messages": MSGS, "max_tokens": 2, **fields})
        assert r.status_code == 200, (fields, r.text)


def test_engine_choice_and_regex_shape_the_answer(srv):
    for seed in range(3):
        r = srv.post(
            COMP,
            {
                "prompt": "Yes or no?",
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": seed,
                "structured_outputs": {"choice": ["yes", "no", "maybe"]},
            },
        )
        choice = r.json()["choices"][0]
        assert choice["text"] in ("yes", "no", "maybe") and choice["finish_reason"] == "stop", choice
    r = srv.post(CHAT, {"messages": MSGS, "max_tokens": 12, "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    content = r.json()["choices"][0]["message"]["content"]
    assert len(content) == 6 and content[3] == "-" and set(content[:3]) <= set("abc"), content


def test_engine_a_json_schema_answer_validates_streamed_and_whole(srv):
    """A random model left free between JSON tokens writes whitespace until max_tokens: the schema asks for
    compact JSON with llguidance's own option, as any client may."""
    schema = {**CITY, "x-guidance": {"whitespace_flexible": False}}
    body = {
        "messages": MSGS,
        "max_tokens": 60,
        "temperature": 0.7,
        "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    }
    whole = srv.post(CHAT, body).json()["choices"][0]
    assert whole["finish_reason"] == "stop", whole
    jsonschema.validate(json.loads(whole["message"]["content"]), CITY)
    events = sse_events(srv.post(CHAT, {**body, "stream": True}).text.splitlines())
    streamed = "".join(
        e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e["choices"]
    )
    assert streamed == whole["message"]["content"]
    compact = srv.post(
        COMP,
        {"prompt": "A record:", "max_tokens": 60, "structured_outputs": {"json": CITY, "disable_any_whitespace": True}},
    ).json()["choices"][0]["text"]
    assert json.dumps(json.loads(compact), separators=(",", ":"), ensure_ascii=False) == compact
