"""The official `openai` Python client against the real server."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_non_stream_and_stream_with_usage(client):
    msgs = [{"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model="tiny-random",
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_non_stream_and_stream(client):
    full = client.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny-random", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens == 12


def test_client_sees_api_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="nope", prompt="x")
    assert exc.value.status_code == 400 and exc.value.code == "model_not_found"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-random"]


def test_client_sends_the_fields_the_server_honours(client):
    msgs = [{"role": "user", "content": "Name a color."}]
    greedy = client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=6, temperature=0)
    topk = client.chat.completions.create(
        model="tiny-random",
        messages=msgs,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        extra_body={"top_k": 1, "chat_template_kwargs": {}, "min_tokens": 1},
    )
    assert topk.choices[0].message.content == greedy.choices[0].message.content
    ok = client.chat.completions.create(
        model="tiny-random",
        messages=msgs,
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
        n=1,
        tool_choice="none",
        user="u-1",
    )
    assert ok.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=2, extra_body={"bogus": 1})
    assert exc.value.code == "unknown_parameter" and exc.value.param == "bogus"
