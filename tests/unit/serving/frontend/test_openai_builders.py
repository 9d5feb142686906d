"""The OpenAI request builders (body → GenerateReqInput), without a server: what each field maps to,
what is refused by name, unknown fields, generation_config defaults, priority order, chat templates."""

from __future__ import annotations

import json

import pytest

from serving.frontend.errors import APIError
from serving.frontend.http.routes.openai_api import Front, chat_input, completion_input
from serving.frontend.http.routes.openai_requests import ChatCompletionRequest, CompletionRequest, decode_body
from serving.frontend.tenants.priority import engine_priority
from serving.frontend.tokenizer_manager import generation_defaults
from serving.frontend.tokenizer_manager.chat_template import ChatTemplateOptions, render
from tests.unit.serving.frontend.front import tokenizer

USER = [{"role": "user", "content": "hi"}]


def comp(front: Front | None = None, **body):
    return completion_input(decode_body(json.dumps({"prompt": "x", **body}).encode(), CompletionRequest),
                            front or Front("m"))


def chat(front: Front | None = None, **body):
    return chat_input(decode_body(json.dumps({"messages": USER, **body}).encode(), ChatCompletionRequest),
                      front or Front("m"))


def refusal(fn, **body) -> APIError:
    with pytest.raises(APIError) as exc:
        fn(**body)
    assert exc.value.status == 400
    return exc.value


def test_completion_fields_map_to_the_engine_contract():
    obj = comp(prompt=["a", "b"], n=3, logprobs=5, echo=True, max_tokens=0, logit_bias={"12": -5.5}, min_tokens=0,
               prompt_logprobs=2, include_stop_str_in_output=True, stop_token_ids=None)
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


@pytest.mark.parametrize("fn,body,param", [
    (comp, {"logprobs": 21}, "logprobs"), (chat, {"top_logprobs": 2}, "top_logprobs"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"), (comp, {"n": 0}, "n"),
    (comp, {"prompt": ["a"] * 9, "n": 8}, "n"), (comp, {"prompt": ["a"] * 65}, "prompt"),
    (comp, {"logit_bias": {"-1": 1}}, "logit_bias"), (comp, {"logit_bias": {"1": -100.5}}, "logit_bias"),
    (comp, {"max_tokens": 0}, "max_tokens"), (chat, {"max_tokens": 0, "echo": True}, "echo"),
    (comp, {"best_of": 2}, "best_of"), (comp, {"suffix": ""}, "suffix"), (chat, {"tool_choice": "auto"}, "tool_choice"),
    (chat, {"guided_json": {}}, "guided_json"), (comp, {"response_format": {"type": "json_object"}}, "response_format"),
    (chat, {"continue_final_message": True}, "continue_final_message"),
    (chat, {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    (chat, {"messages": [{"role": "user", "content": "x", "nickname": "y"}]}, "messages[0].nickname"),
    (comp, {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
])
def test_refused_by_name(fn, body, param):
    err = refusal(fn, **body)
    assert err.param == param, err.message


def test_unknown_fields_counted_under_allow_unknown_fields():
    counted = []
    front = Front("m", allow_unknown=True, count_ignored=lambda route, name: counted.append((route, name)))
    obj = chat(front, add_special_tokens=True, my_field=1, messages=[{"role": "user", "content": "x", "extra": 1}])
    assert sorted(obj.ignored_fields) == ["add_special_tokens", "messages[0].extra", "my_field"]
    assert sorted(counted) == [("/v1/chat/completions", "add_special_tokens"), ("/v1/chat/completions", "other"),
                               ("/v1/chat/completions", "other")]
    assert refusal(comp, wibble=2).code == "unknown_parameter"


def test_a_requests_own_template_needs_trust():
    assert refusal(chat, chat_template="{{ 1 }}").code == "chat_template_untrusted"
    assert chat(Front("m", trust_template=True), chat_template="{{ 1 }}").template.chat_template == "{{ 1 }}"


def test_generation_config_fills_unset_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 40, "do_sample": True, "bos_token_id": 1}))
    defaults = generation_defaults.load(tmp_path, "auto")
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 40}
    assert generation_defaults.load(tmp_path, "none") == {} == generation_defaults.load(tmp_path / "no", "auto")
    obj = chat(Front("m", defaults=defaults), temperature=0.1)
    assert (obj.sampling.temperature, obj.sampling.top_k, obj.sampling.top_p, obj.max_new_tokens) == (0.1, 20, 0.95, 40)
    assert obj.param_sources == {"temperature": "request", "top_p": "generation_config", "top_k": "generation_config",
                                 "min_p": "default", "repetition_penalty": "default",
                                 "max_new_tokens": "generation_config"}
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
    assert render(tok, USER, ChatTemplateOptions(add_generation_prompt=False, kwargs={"flavour": "!"},
                                                 documents=[{"text": "D"}]), tpl) == "[user:hi]D!"
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
