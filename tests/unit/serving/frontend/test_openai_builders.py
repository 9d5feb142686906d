"""The OpenAI request builders (body → GenerateReqInput), without a server: what each field maps to,
what is refused by name, unknown fields, generation_config defaults, priority order, chat templates."""

from __future__ import annotations

import json

import pytest

from serving.frontend.errors import APIError
from serving.frontend.http.routes.openai_api import Front, chat_input, completion_input
from serving.frontend.http.routes.openai_requests import ChatCompletionRequest, CompletionRequest, decode_body
from serving.frontend.http.routes.openai_structured import BOUNDED_WHITESPACE
from serving.frontend.output_parsing import ParsingConfig
from serving.frontend.tenants.priority import engine_priority
from serving.frontend.tokenizer_manager import generation_defaults
from serving.frontend.tokenizer_manager.chat_template import ChatTemplateOptions, render
from tests.unit.serving.frontend.front import tokenizer

USER = [{"role": "user", "content": "hi"}]


def comp(front: Front | None = None, **body):
    return completion_input(
        decode_body(json.dumps({"prompt": "x", **body}).encode(), CompletionRequest), front or Front("m")
    )


def chat(front: Front | None = None, **body):
    return chat_input(
        decode_body(json.dumps({"messages": USER, **body}).encode(), ChatCompletionRequest), front or Front("m")
    )


def refusal(fn, **body) -> APIError:
    with pytest.raises(APIError) as exc:
        fn(**body)
    assert exc.value.status == 400
    return exc.value


def test_completion_fields_map_to_the_engine_contract():
    obj = comp(
        prompt=["a", "b"],
        n=3,
        logprobs=5,
        echo=True,
        max_tokens=0,
        logit_bias={"12": -5.5},
        min_tokens=0,
        prompt_logprobs=2,
        include_stop_str_in_output=True,
        stop_token_ids=None,
    )
    assert obj.prompt is None and obj.batch == ["a", "b"] and obj.n == 3 and obj.echo
    sp = obj.sampling
    assert sp.logprobs == 5 and sp.prompt_logprobs == 5 and sp.logit_bias == {12: -5.5}
    assert obj.max_new_tokens == 0 and obj.prompt_logprobs_field and obj.include_stop_str_in_output
    assert comp(prompt=[[1, 2], [3]]).batch == [[1, 2], [3]] and comp(prompt=[[1, 2]]).prompt == [1, 2]
    assert comp(min_tokens=4, max_tokens=8).sampling.min_tokens == 4


def test_chat_fields_map_to_the_engine_contract():
    obj = chat(logprobs=True, top_logprobs=4, n=2, max_completion_tokens=7, max_tokens=99, safety_identifier="s")
    assert obj.sampling.logprobs == 4 and obj.n == 2 and obj.max_new_tokens == 7 and obj.user == "s"
    assert chat(logprobs=True).sampling.logprobs == 0 and chat(logprobs=False).sampling.logprobs is None
    assert obj.param_names == {"max_new_tokens": "max_completion_tokens"}
    opts = chat(continue_final_message=True, messages=USER + [{"role": "assistant", "content": "so"}]).template
    assert opts.continue_final_message and not opts.add_generation_prompt


@pytest.mark.parametrize(
    "fn,body,param",
    [
        (comp, {"logprobs": 21}, "logprobs"),
        (chat, {"top_logprobs": 2}, "top_logprobs"),
        (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (comp, {"n": 0}, "n"),
        (comp, {"prompt": ["a"] * 9, "n": 8}, "n"),
        (comp, {"prompt": ["a"] * 65}, "prompt"),
        (comp, {"logit_bias": {"-1": 1}}, "logit_bias"),
        (comp, {"logit_bias": {"1": -100.5}}, "logit_bias"),
        (comp, {"max_tokens": 0}, "max_tokens"),
        (chat, {"max_tokens": 0, "echo": True}, "echo"),
        (comp, {"best_of": 2}, "best_of"),
        (comp, {"suffix": ""}, "suffix"),
        (chat, {"tool_choice": "auto"}, "tool_choice"),
        (chat, {"guided_json": {}}, "guided_json"),
        (comp, {"response_format": {"type": "xml"}}, "response_format.type"),
        (chat, {"continue_final_message": True}, "continue_final_message"),
        (chat, {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        (chat, {"messages": [{"role": "user", "content": "x", "nickname": "y"}]}, "messages[0].nickname"),
        (comp, {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ],
)
def test_refused_by_name(fn, body, param):
    err = refusal(fn, **body)
    assert err.param == param, err.message


def test_unknown_fields_counted_under_allow_unknown_fields():
    counted = []
    front = Front("m", allow_unknown=True, count_ignored=lambda route, name: counted.append((route, name)))
    obj = chat(front, add_special_tokens=True, my_field=1, messages=[{"role": "user", "content": "x", "extra": 1}])
    assert sorted(obj.ignored_fields) == ["add_special_tokens", "messages[0].extra", "my_field"]
    assert sorted(counted) == [
        ("/v1/chat/completions", "add_special_tokens"),
        ("/v1/chat/completions", "other"),
        ("/v1/chat/completions", "other"),
    ]
    assert refusal(comp, wibble=2).code == "unknown_parameter"


def test_a_requests_own_template_needs_trust():
    assert refusal(chat, chat_template="{{ 1 }}").code == "chat_template_untrusted"
    assert chat(Front("m", trust_template=True), chat_template="{{ 1 }}").template.chat_template == "{{ 1 }}"


def test_generation_config_fills_unset_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 40, "do_sample": True, "bos_token_id": 1}
        )
    )
    defaults = generation_defaults.load(tmp_path, "auto")
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 40}
    assert generation_defaults.load(tmp_path, "none") == {} == generation_defaults.load(tmp_path / "no", "auto")
    obj = chat(Front("m", defaults=defaults), temperature=0.1)
    assert (obj.sampling.temperature, obj.sampling.top_k, obj.sampling.top_p, obj.max_new_tokens) == (0.1, 20, 0.95, 40)
    assert obj.param_sources == {
        "temperature": "request",
        "top_p": "generation_config",
        "top_k": "generation_config",
        "min_p": "default",
        "repetition_penalty": "default",
        "max_new_tokens": "generation_config",
    }
    assert comp().param_sources["max_new_tokens"] == "default" and comp().max_new_tokens == 16


def test_priority_order():
    # lower-first (vLLM): a lower value is served sooner; the engine sorts higher first
    assert engine_priority("lower-first", 0, -5) == 0  # cannot claim better than its tenant (0)
    assert engine_priority("lower-first", 0, 5) == -5 and engine_priority("lower-first", 3, None) == -3
    assert engine_priority("lower-first", 0, 1) > engine_priority("lower-first", 0, 2)
    assert engine_priority("higher-first", 2, 9) == 2 and engine_priority("higher-first", 2, 1) == 1


def test_chat_template_options_render():
    tok = tokenizer()
    tpl = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    tpl += "{% if documents %}{{ documents[0].text }}{% endif %}{{ flavour | default('') }}"
    assert render(tok, USER, ChatTemplateOptions(), tpl) == "[user:hi]>"
    assert (
        render(
            tok,
            USER,
            ChatTemplateOptions(add_generation_prompt=False, kwargs={"flavour": "!"}, documents=[{"text": "D"}]),
            tpl,
        )
        == "[user:hi]D!"
    )
    assert render(tok, USER, ChatTemplateOptions(chat_template="<{{ messages | length }}>"), tpl) == "<1>"
    with pytest.raises(APIError) as exc:
        render(tok, USER, ChatTemplateOptions(chat_template="{{ raise_exception('nope: ' + messages[0].role) }}"), tpl)
    assert exc.value.param == "chat_template" and "nope: user" in exc.value.message


def test_span_attributes_name_ignored_fields_and_sources():
    from serving.frontend.http.routes.generation import _request_attributes

    obj = chat(Front("m", allow_unknown=True), temperature=0.5, wibble=1)
    attrs = _request_attributes(obj)
    assert attrs["sightline.ignored_fields"] == ["wibble"]
    assert attrs["sightline.param_source.temperature"] == "request"
    assert attrs["sightline.param_source.top_p"] == "default"


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HERMES = Front("m", parsing=ParsingConfig(tool_parser="hermes"))
THINKING = Front("m", parsing=ParsingConfig(tool_parser="hermes", reasoning="qwen3", think_end_ids=(7, 8)))


def test_structured_outputs_map_to_one_constraint_named_by_its_field():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    obj = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    (c,) = obj.constraints
    bounded = {"x-guidance": {"whitespace_pattern": BOUNDED_WHITESPACE}}  # unless the request says otherwise
    closed = {**schema, "additionalProperties": False, **bounded}  # as vLLM's default backend reads it
    assert (c.so.kind, json.loads(c.so.spec), c.param) == ("json_schema", closed, "response_format.json_schema.schema")
    kept = comp(structured_outputs={"json": schema, "disable_additional_properties": False}).sampling.structured
    assert json.loads(kept.spec) == {**schema, **bounded}
    own = {**schema, "x-guidance": {"whitespace_flexible": True}}  # the schema's own whitespace setting is kept
    assert json.loads(comp(structured_outputs={"json": own}).sampling.structured.spec)["x-guidance"] == {
        "whitespace_flexible": True
    }
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": own}}  # no request options at all
    assert json.loads(chat(response_format=rf).sampling.structured.spec)["x-guidance"] == {"whitespace_flexible": True}
    assert obj.sampling.structured == c.so
    assert json.loads(chat(response_format={"type": "json_object"}).sampling.structured.spec) == {
        "type": "object",
        **bounded,
    }
    assert chat(response_format={"type": "text"}).sampling.structured is None
    compact = comp(structured_outputs={"json": json.dumps(schema), "disable_any_whitespace": True}).sampling.structured
    assert json.loads(compact.spec)["x-guidance"] == {"whitespace_flexible": False}
    assert comp(structured_outputs={"choice": ["a", "b"]}).constraints[0].param == "structured_outputs.choice"
    assert comp(structured_outputs={"regex": "a+"}).sampling.structured.kind == "regex"
    assert comp(structured_outputs={"grammar": 'start: "x"'}).sampling.structured.kind == "grammar"
    thought = chat(THINKING, response_format={"type": "json_object"}).sampling.structured
    assert thought.after_token_ids == (7, 8)  # the constraint starts after </think>
    off = chat(THINKING, response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})
    assert off.sampling.structured.after_token_ids == ()
    # an object schema beside json_object says which object (instructor's JSON mode with the schema in extra_body)
    (narrowed,) = chat(response_format={"type": "json_object"}, structured_outputs={"json": schema}).constraints
    assert narrowed.param == "structured_outputs.json" and json.loads(narrowed.so.spec) == closed


@pytest.mark.parametrize(
    "fn,body,param,code",
    [
        (
            chat,
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "conflicting_constraints",
        ),
        (
            chat,
            {"response_format": {"type": "json_object"}, "structured_outputs": {"json": {"type": "array"}}},
            "structured_outputs.json",
            "conflicting_constraints",
        ),  # not an object: not a narrowing
        (
            comp,
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.choice",
            "conflicting_constraints",
        ),
        (
            chat,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "invalid_schema",
        ),
        (comp, {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_schema"),
        (
            comp,
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            None,
        ),
        (
            comp,
            {"structured_outputs": {"structural_tag": {}}},
            "structured_outputs.structural_tag",
            "unsupported_parameter",
        ),
        (comp, {"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend", "unknown_parameter"),
        (chat, {"guided_regex": "a"}, "guided_regex", "unsupported_parameter"),
        (
            chat,
            {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "conflicting_constraints",
        ),
        (chat, {"tools": [{"type": "function", "function": {"description": "-"}}]}, "tools[0].function.name", None),
        (
            chat,
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
            "invalid_schema",
        ),
        (chat, {"tools": [TOOL, {"type": "code_interpreter", "function": {"name": "g"}}]}, "tools[1].type", None),
        (chat, {"tools": [TOOL, TOOL]}, "tools", None),
        (chat, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "no"}}}, "tool_choice", None),
        (chat, {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", None),
    ],
)
def test_structured_and_tool_fields_refused_by_name(fn, body, param, code):
    err = refusal(fn, front=HERMES, **body) if fn is chat else refusal(fn, **body)
    assert (err.param, err.code) == (param, code), err.message
    if param == "guided_regex":
        assert "structured_outputs.regex" in err.message


def test_tools_render_and_are_read_and_forced_by_tool_choice():
    auto = chat(HERMES, tools=[TOOL])
    assert auto.template.tools == [TOOL] and auto.parsing.tools.name == "hermes" and auto.sampling.structured is None
    assert auto.parsing.max_calls is None
    assert chat(HERMES, tools=[TOOL], parallel_tool_calls=False).parsing.max_calls == 1
    none = chat(HERMES, tools=[TOOL], tool_choice="none")
    assert none.template.tools == [TOOL] and none.parsing is None
    assert [c.param for c in none.constraints] == ["tools[0].function.parameters"]  # checked whatever the choice
    forced = chat(
        HERMES,
        tools=[TOOL, {"type": "function", "function": {"name": "now"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    grammar = forced.sampling.structured
    assert grammar.kind == "grammar" and '\\"get_weather\\"' in grammar.spec and "now" not in grammar.spec
    assert [c.param for c in forced.constraints] == [
        "tools[0].function.parameters",
        "tools[1].function.parameters",
        "tools",
    ]
    assert chat(THINKING, tools=[TOOL], tool_choice="required").sampling.structured.after_token_ids == (7, 8)
    assert forced.parsing.max_calls == 1 and "block (" not in grammar.spec  # a named function: one call
    assert "start: block (" in chat(HERMES, tools=[TOOL], tool_choice="required").sampling.structured.spec
    refusal(chat, front=Front("m", parsing=ParsingConfig(tool_parser=None)), tools=[TOOL])  # --tool-call-parser none
    assert chat(Front("m"), tools=[TOOL], tool_choice="none").parsing is None
