"""Bad input gets an OpenAI-style error with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

LONG = "hello " * 2100  # tiny-random's context is 2048 tokens

# (name, method, path, body (dict, or raw str), status, param, code)
BAD = [
    ("malformed json", "POST", "/v1/completions", '{"prompt": "x",', 400, None, "invalid_json"),
    ("empty body", "POST", "/v1/completions", "", 400, None, "invalid_json"),
    ("array body", "POST", "/v1/chat/completions", "[1, 2]", 400, None, "invalid_type"),
    (
        "max_tokens wrong type",
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": "ten"},
        400,
        "max_tokens",
        "invalid_type",
    ),
    (
        "temperature wrong type",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        400,
        "temperature",
        "invalid_type",
    ),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt", "invalid_type"),
    ("missing messages", "POST", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "invalid_type"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 400, "model", "model_not_found"),
    ("negative temperature", "POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("top_p zero", "POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("max_tokens zero", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (
        "frequency_penalty too big",
        "POST",
        "/v1/completions",
        {"prompt": "x", "frequency_penalty": 5},
        400,
        "frequency_penalty",
        None,
    ),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty_prompt"),
    ("empty token list", "POST", "/v1/completions", {"prompt": []}, 400, "prompt", "empty_prompt"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, 400, "messages", "empty_prompt"),
    (
        "bad role",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
        None,
    ),
    (
        "prompt longer than context",
        "POST",
        "/v1/completions",
        {"prompt": LONG},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "prompt + max_tokens over context",
        "POST",
        "/v1/completions",
        # long: over the context window on purpose (a validation case: refused before it runs)
        {"prompt": "x", "max_tokens": 5000},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "n over --max-n",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "n": 17},
        400,
        "n",
        None,
    ),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt", "invalid_token_id"),
    (
        "too many stop strings",
        "POST",
        "/v1/completions",
        {"prompt": "x", "stop": [str(i) for i in range(40)]},
        400,
        "stop",
        None,
    ),
    ("logprobs over 20", "POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    (
        "unknown field",
        "POST",
        "/v1/completions",
        {"prompt": "x", "temprature": 1},
        400,
        "temprature",
        "unknown_parameter",
    ),
    (
        "own chat_template untrusted",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        400,
        "chat_template",
        "chat_template_untrusted",
    ),
    (
        "tools empty",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        400,
        "tools",
        None,
    ),
    (
        "stream_options without stream",
        "POST",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    ("generate: text and input_ids", "POST", "/generate", {"text": "x", "input_ids": [1]}, 400, "text", None),
    (
        "generate: unknown sampling field",
        "POST",
        "/generate",
        {"text": "x", "sampling_params": {"temprature": 1}},
        400,
        "sampling_params.temprature",
        "unknown_parameter",
    ),
    ("unknown route", "POST", "/v1/nope", {}, 404, None, None),
    ("wrong method", "GET", "/v1/completions", None, 405, None, None),
]


@pytest.mark.parametrize("name,method,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_good_request(tiny_server, name, method, path, body, status, param, code):
    if method == "GET":
        r = httpx.get(tiny_server.url + path)
    else:
        r = tiny_server.post(path, body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 5
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    good = tiny_server.post("/v1/completions", {"prompt": "good", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_bad_requests_leave_nothing_in_flight(tiny_server):
    for _, method, path, body, status, *_ in BAD:
        if method == "POST":
            assert tiny_server.post(path, body).status_code == status
    tiny_server.barrier()  # the Scheduler's stats are fresh: nothing reached its queue
    state = tiny_server.debug()
    assert state["in_flight"] == 0 and state["scheduler"]["num_waiting"] == state["scheduler"]["num_running"] == 0
    assert httpx.get(tiny_server.url + "/health").status_code == 200
