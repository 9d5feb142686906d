"""The OpenAI request contract, against one real tiny-random server: every field of OpenAI's chat
and completions request schemas, and the vLLM extensions clients send, is either honoured (its
effect observed: in the output, on usage, on /tokenize, or a different response) or refused
with a 400 naming it; `null` is accepted wherever OpenAI allows it; an unknown field is refused
by name; none is dropped unseen.  `COVERAGE` lists every field and how it is covered, and a
test checks it against the request structs, so a field cannot be added without its contract.

The chat template options are read on /tokenize with a Qwen3-style template
(tests/fixtures/chat_templates/qwen3_like.jinja, given as --chat-template).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from serving.frontend.http.routes.openai_requests import ChatCompletionRequest, CompletionRequest
from tests.server_util import ServerProc, sse_events

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3_like.jinja"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Tell me a story."}]
PROMPT = "Once upon a time"

# how each field is covered: effect (observed below), refused (400 naming it), accepted (no observable effect on
# this model; checked to be read, e.g. its range). The constraints' effect on the output (response_format,
# structured_outputs, a forced tool_choice) is observed in test_structured_outputs.py and test_tool_calling.py.
COVERAGE = {
    "model": "effect",
    "max_tokens": "effect",
    "max_completion_tokens": "effect",
    "temperature": "effect",
    "top_p": "effect",
    "n": "effect",
    "stream": "effect",
    "stream_options": "effect",
    "stop": "effect",
    "seed": "effect",
    "presence_penalty": "effect",
    "frequency_penalty": "effect",
    "logit_bias": "effect",
    "user": "accepted",
    "cache_salt": "effect",
    "priority": "accepted",
    "top_k": "effect",
    "min_p": "effect",
    "repetition_penalty": "effect",
    "min_tokens": "effect",
    "ignore_eos": "accepted",
    "stop_token_ids": "effect",
    "skip_special_tokens": "accepted",
    "include_stop_str_in_output": "effect",
    "prompt_logprobs": "effect",
    "response_format": "accepted",
    "structured_outputs": "accepted",
    "guided_json": "refused",
    "guided_regex": "refused",
    "guided_choice": "refused",
    "guided_grammar": "refused",
    "guided_decoding_backend": "refused",
    "guided_whitespace_pattern": "refused",
    "lora_request": "refused",
    # completions
    "prompt": "effect",
    "echo": "effect",
    "best_of": "refused",
    "suffix": "refused",
    "logprobs": "effect",
    # chat
    "messages": "effect",
    "top_logprobs": "effect",
    "tools": "effect",
    "tool_choice": "accepted",
    "functions": "refused",
    "function_call": "refused",
    "parallel_tool_calls": "accepted",
    "audio": "refused",
    "modalities": "refused",
    "prediction": "refused",
    "reasoning_effort": "refused",
    "verbosity": "refused",
    "web_search_options": "refused",
    "metadata": "refused",
    "store": "refused",
    "service_tier": "refused",
    "prompt_cache_key": "refused",
    "safety_identifier": "accepted",
    "chat_template": "effect",
    "chat_template_kwargs": "effect",
    "add_generation_prompt": "effect",
    "continue_final_message": "effect",
    "documents": "effect",
    "speculative": "accepted",  # its effect (never speculated when false): tests/e2e/test_speculative_server.py
}
REFUSED = [  # (route, field, a value it refuses)
    (COMP, "best_of", 2),
    (COMP, "suffix", "!"),
    (CHAT, "tool_choice", "auto"),  # tool_choice without tools
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", "auto"),
    (COMP, "guided_json", {}),
    (CHAT, "guided_regex", "a+"),
    (CHAT, "guided_choice", ["a"]),
    (COMP, "guided_grammar", "root ::= x"),
    (CHAT, "guided_decoding_backend", "x"),
    (CHAT, "guided_whitespace_pattern", " "),
    (CHAT, "lora_request", {"name": "x"}),
    (CHAT, "audio", {}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "verbosity", "low"),
    (CHAT, "web_search_options", {}),
    (CHAT, "metadata", {"k": "v"}),
    (CHAT, "store", True),
    (CHAT, "service_tier", "flex"),
    (CHAT, "prompt_cache_key", "k"),
    (CHAT, "frobnicate", 1),
    (COMP, "add_special_tokens", False),
]
NULLABLE = (
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
    "response_format",
    "priority",
    "cache_salt",
    "model",
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProc(
        "--chat-template", str(TEMPLATE), "--trust-request-chat-template", tmpdir=tmp_path_factory.mktemp("contract")
    )
    try:
        yield s
    finally:
        s.stop()


def ok(srv, path: str, body: dict) -> dict:
    r = srv.post(path, body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(srv, path: str, body: dict, param: str) -> dict:
    r = srv.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def comp(srv, **kw) -> dict:
    return ok(srv, COMP, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw})


def text(body: dict) -> str:
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def test_every_declared_field_has_a_contract():
    declared = set(ChatCompletionRequest.__struct_fields__) | set(CompletionRequest.__struct_fields__)
    assert declared == set(COVERAGE), declared ^ set(COVERAGE)
    assert {f for _, f, _ in REFUSED} >= {f for f, how in COVERAGE.items() if how == "refused"}


@pytest.mark.parametrize("path,field,value", REFUSED, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in REFUSED])
def test_refused_by_name(srv, path, field, value):
    base = {"messages": MSGS} if path == CHAT else {"prompt": PROMPT}
    refused(srv, path, {**base, "max_tokens": 2, field: value}, field)


def test_nulls_mean_default(srv):
    nulls = dict.fromkeys(NULLABLE)
    assert text(ok(srv, COMP, {"prompt": PROMPT, **nulls, "max_tokens": 8, "temperature": 0})) == text(comp(srv))
    chat_nulls = {
        **nulls,
        "max_completion_tokens": 2,
        "logprobs": None,
        "top_logprobs": None,
        "tools": None,
        "tool_choice": None,
        "chat_template_kwargs": None,
        "add_generation_prompt": None,
        "continue_final_message": None,
        "documents": None,
        "chat_template": None,
    }
    body = ok(srv, CHAT, {"messages": MSGS, **chat_nulls})
    assert body["usage"]["completion_tokens"] >= 1
    ok(srv, COMP, {"prompt": PROMPT, "max_tokens": 2, "echo": None, "logprobs": None, "best_of": None, "suffix": None})
    ok(
        srv,
        CHAT,
        {
            "messages": MSGS,
            "max_tokens": 2,
            "tool_choice": "none",
            "modalities": ["text"],
            "store": False,
            "service_tier": "auto",
            "safety_identifier": "u-1",
            "user": "u-1",
            "priority": 3,
        },
    )


def test_sampling_fields_take_effect(srv):
    greedy = text(comp(srv, max_tokens=16))
    for kw in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-9}):  # each leaves only the most likely token
        assert text(comp(srv, max_tokens=16, temperature=1.0, seed=7, **kw)) == greedy, kw
    a = text(comp(srv, max_tokens=16, temperature=1.5, seed=11))
    assert a == text(comp(srv, max_tokens=16, temperature=1.5, seed=11))  # seed: reproducible
    assert a != greedy and a != text(comp(srv, max_tokens=16, temperature=1.5, seed=12))
    echo = (PROMPT + text(comp(srv, max_tokens=32))) * 3  # a prompt the greedy output goes on repeating
    for kw in ({"repetition_penalty": 3.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert text(comp(srv, prompt=echo, max_tokens=32, **kw)) != text(comp(srv, prompt=echo, max_tokens=32)), kw


def test_length_and_stop_fields(srv):
    assert comp(srv, max_tokens=5, ignore_eos=True)["usage"]["completion_tokens"] == 5
    chat = ok(srv, CHAT, {"messages": MSGS, "max_completion_tokens": 3, "max_tokens": 9, "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 3  # max_completion_tokens wins over max_tokens
    full = text(comp(srv, max_tokens=16))
    stop = full[len(full) // 2 :][:3]
    stopped = comp(srv, max_tokens=16, stop=[stop])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stop not in text(stopped)
    ids = ok(srv, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    at = 4
    first = ids["output_ids"].index(ids["output_ids"][at])
    cut = comp(srv, stop_token_ids=[ids["output_ids"][at]])
    assert cut["usage"]["completion_tokens"] == first + 1 and cut["choices"][0]["finish_reason"] == "stop"


def test_stream_fields(srv):
    r = srv.post(
        COMP,
        {
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is not None for e in events[:-1])
    refused(srv, COMP, {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options")


def test_tenancy_and_identity_fields(srv):
    refused(srv, COMP, {"prompt": PROMPT, "model": "other"}, "model")
    refused(srv, COMP, {"prompt": PROMPT, "priority": 5000}, "priority")  # read and range-checked
    refused(srv, CHAT, {"messages": MSGS, "user": "u" * 300}, "user")
    prompt = "A cached prefix that is long enough to fill a few pages of the cache " * 3
    comp(srv, prompt=prompt, max_tokens=1)
    assert comp(srv, prompt=prompt, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    salted = comp(srv, prompt=prompt, max_tokens=1, cache_salt="contract-salt")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _rendered(srv, body: dict) -> str:
    toks = ok(srv, "/tokenize", body)
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] > 0
    return ok(srv, "/detokenize", {"tokens": toks["tokens"]})["prompt"]


def test_chat_template_options_on_tokenize(srv):
    plain = _rendered(srv, {"messages": MSGS})
    assert plain.endswith("<|im_start|>assistant\n") and "<think>" not in plain
    assert "<think>" in _rendered(srv, {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}})
    assert not _rendered(srv, {"messages": MSGS, "add_generation_prompt": False}).endswith("assistant\n")
    convo = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 7}'}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "lookup"},
        {"role": "assistant", "content": "The answer is", "reasoning_content": "think first"},
    ]
    cont = _rendered(
        srv,
        {
            "messages": convo,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "documents": [{"title": "Doc", "text": "body text"}],
        },
    )
    assert cont.endswith("The answer is") and "<think>think first</think>" in cont
    assert "lookup(q=7)" in cont and "<tool_response id=c1 name=lookup>42" in cont and "Doc: body text" in cont
    assert _rendered(srv, {"messages": MSGS, "chat_template": "X{{ messages[0].content }}Y"}) == "XTell me a story.Y"
    toks = ok(srv, "/v1/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert len(toks["token_strs"]) == toks["count"]
    assert httpx.get(srv.url + "/version", timeout=10).json()["version"]


def test_tools_are_rendered_into_the_prompt(srv):
    template = "{{ messages[0].content }}{% for t in tools or [] %} {{ t.function.name }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "lookup_the_weather"}}]
    bare = ok(srv, CHAT, {"messages": MSGS, "max_tokens": 1, "chat_template": template})["usage"]["prompt_tokens"]
    shown = ok(
        srv,
        CHAT,
        {
            "messages": MSGS,
            "max_tokens": 1,
            "chat_template": template,
            "tools": tools,
            "tool_choice": "none",
            "parallel_tool_calls": False,
        },
    )
    assert shown["usage"]["prompt_tokens"] > bare
    assert (
        ok(srv, "/tokenize", {"messages": MSGS, "chat_template": template, "tools": tools})["count"]
        == shown["usage"]["prompt_tokens"]
    )


def test_chat_template_options_change_the_prompt(srv):
    base = ok(srv, CHAT, {"messages": MSGS, "max_tokens": 1})["usage"]["prompt_tokens"]
    thinking = ok(srv, CHAT, {"messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert thinking["usage"]["prompt_tokens"] > base
    own = ok(srv, CHAT, {"messages": MSGS, "max_tokens": 1, "chat_template": "{{ messages[0].content }}"})
    assert own["usage"]["prompt_tokens"] < base
    tokens = ok(srv, "/tokenize", {"messages": MSGS})["count"]
    assert tokens == base  # /tokenize counts what a chat completion will report


BAD = [  # (route, body, the param named)
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (COMP, {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    (COMP, {"prompt": ["a", "b", "c", "d", "e"], "n": 16}, "n"),
    (COMP, {"prompt": ["x"] * 65}, "prompt"),
    (CHAT, {"messages": MSGS, "n": 17}, "n"),
    (COMP, {"prompt": PROMPT, "logit_bias": {"12": 101}}, "logit_bias"),
    (COMP, {"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    (COMP, {"prompt": PROMPT, "logit_bias": {"999999": 1}}, "logit_bias"),  # no such token id
    (COMP, {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    (COMP, {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (COMP, {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    (
        CHAT,
        {
            "messages": MSGS + [{"role": "assistant", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        "continue_final_message",
    ),
    (CHAT, {"messages": MSGS, "chat_template": "{{ raise_exception('no such role here') }}"}, "chat_template"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    (
        CHAT,
        {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
        "response_format.json_schema.schema",
    ),
    (COMP, {"prompt": PROMPT, "response_format": {"type": "xml"}}, "response_format.type"),
    (COMP, {"prompt": PROMPT, "structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    (
        CHAT,
        {
            "messages": MSGS,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    (
        CHAT,
        {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
    ),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[p for _, _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(srv, path, body, param):
    err = refused(srv, path, body, param)
    if param == "chat_template" and path == CHAT:
        assert "no such role here" in err["message"]  # the template's own message


def test_still_serving_after_the_refusals(srv):
    assert comp(srv, max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3


def test_logprobs_n_echo_bias_min_tokens_and_stop_str_take_effect(srv):
    chat = ok(srv, CHAT, {"messages": MSGS, "max_tokens": 2, "logprobs": True, "top_logprobs": 3, "n": 2})
    assert len(chat["choices"]) == 2 and len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    echo = ok(srv, COMP, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert text(echo) == PROMPT and echo["choices"][0]["logprobs"]["tokens"]
    scored = ok(srv, COMP, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1})
    assert scored["choices"][0]["prompt_logprobs"][0] is None and len(scored["choices"][0]["prompt_logprobs"]) > 1
    batch = ok(srv, COMP, {"prompt": ["a b", "c d"], "max_tokens": 2, "n": 2})
    assert sorted(c["index"] for c in batch["choices"]) == [0, 1, 2, 3]
    apple = ok(srv, "/tokenize", {"prompt": " apple", "add_special_tokens": False})["tokens"][-1]
    biased = comp(srv, max_tokens=4, temperature=1.0, logit_bias={str(apple): 100})
    assert ok(srv, "/tokenize", {"prompt": text(biased), "add_special_tokens": False})["tokens"] == [apple] * 4
    greedy_first = ok(srv, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})[
        "output_ids"
    ][0]
    assert (
        comp(srv, max_tokens=1, logit_bias={str(greedy_first): -100})["choices"][0]["text"]
        != comp(srv, max_tokens=1)["choices"][0]["text"]
    )
    greedy = ok(srv, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    first = greedy["output_ids"][0]
    assert comp(srv, max_tokens=6, stop_token_ids=[first])["usage"]["completion_tokens"] == 1
    assert comp(srv, max_tokens=6, min_tokens=6, stop_token_ids=[first])["usage"]["completion_tokens"] == 6
    full = text(comp(srv, max_tokens=16))
    stop = full[len(full) // 2 :][:3]
    kept = comp(srv, max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    assert kept["choices"][0]["finish_reason"] == "stop" and text(kept).endswith(stop)


def test_param_sources_in_debug_requests(srv):
    r = srv.post(COMP, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "top_p": None})
    assert r.status_code == 200, r.text
    entry = httpx.get(f"{srv.url}/debug/requests/{r.headers['x-request-id']}", timeout=10).json()
    assert entry["param_sources"]["temperature"] == "request" and entry["param_sources"]["top_p"] == "default"
    assert entry["param_sources"]["max_new_tokens"] == "request"
