"""Logprobs, echo, `n` and batched prompts through the official `openai` client against a real server
(tiny-random: its logits are checked against a direct forward of the same weights in-process)."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from tests.server_util import chat_ids

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64 log-probabilities of a direct forward over `ids` (transformers, float32)."""
    with torch.inference_mode():
        logits = model.hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)


def test_echo_with_max_tokens_0_scores_the_prompt_like_a_direct_forward(client, tiny):
    ids = tiny.tokenizer(PROMPT)["input_ids"]
    out = client.completions.create(model=None, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _log_softmax(tiny, ids)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert sum(lp.token_logprobs[1:]) == pytest.approx(sum(want), abs=1e-3)
    # each position lists its top alternative (the model's argmax) and the prompt token itself
    for i, top in enumerate(lp.top_logprobs[1:]):
        best = ref[i].argmax().item()
        assert tiny.tokenizer.decode([best]) in top
        assert max(top.values()) == pytest.approx(ref[i, best].item(), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)


def test_echo_with_a_completion_appends_its_tokens_after_the_prompts(client, tiny):
    ids = tiny.tokenizer(PROMPT)["input_ids"]
    out = client.completions.create(model=None, prompt=ids, echo=True, logprobs=2, max_tokens=5, temperature=0)
    plain = client.completions.create(model=None, prompt=ids, max_tokens=5, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == tiny.tokenizer.decode(ids) + plain.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 5
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])  # 2 alternatives, and the token itself
    assert out.usage.completion_tokens == 5


def test_chat_logprobs_streamed_and_whole_agree_with_the_greedy_tokens(client, tiny):
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model=None, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    ids = chat_ids(tiny, "Say something.")
    ref_tokens = []
    seq = list(ids)
    for entry in content:
        ref = _log_softmax(tiny, seq)[-1]
        best = ref.argmax().item()
        ref_tokens.append(best)
        seq.append(best)
        assert entry.logprob == pytest.approx(ref[best].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or "\ufffd" in entry.token
    streamed = []
    for chunk in client.chat.completions.create(
        model=None, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    # the second request finds the prompt in the prefix cache, so its first position is computed by another
    # kernel path (a 1-token extend over cached KV instead of the whole prefill): float32 rounding, not drift
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=5e-5)


def test_n_choices_stream_with_their_own_index_and_usage_counts_each(client):
    indices: dict[int, str] = {}
    finishes = {}
    usage = None
    for chunk in client.chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for c in chunk.choices:
            indices[c.index] = indices.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert sorted(indices) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert usage.completion_tokens == 18  # 6 per choice, the prompt counted once
    assert len(set(indices.values())) > 1  # seeds seed, seed+1, seed+2: different samples
    again = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6, temperature=1.0, seed=11
    )
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == [
        indices[i] for i in range(3)
    ]  # a seeded request reproduces, streamed or not


def test_batched_prompts_give_one_choice_per_prompt_times_n(client, tiny):
    prompts = ["One two three", "Red green blue"]
    out = client.completions.create(model=None, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in out.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: the choices of one prompt agree
    single = client.completions.create(model=None, prompt=prompts[1], max_tokens=4, temperature=0)
    assert by[2] == single.choices[0].text
    prompt_tokens = sum(len(tiny.tokenizer(p)["input_ids"]) for p in prompts)
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == 16
    ids = [tiny.tokenizer(p)["input_ids"] for p in prompts]
    as_ids = client.completions.create(model=None, prompt=ids, max_tokens=4, temperature=0)
    assert {c.index: c.text for c in as_ids.choices} == {0: by[0], 1: by[2]}


def test_siblings_reuse_the_first_choices_prefill(tiny_server, client):
    prompt = "A long shared prompt " * 20
    out = client.completions.create(model=None, prompt=prompt, n=4, max_tokens=2, temperature=0)
    assert len(out.choices) == 4
    # the first choice prefilled the prompt; its siblings found it in the prefix cache
    details = tiny_server.post("/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 2, "temperature": 0}).json()[
        "sightline"
    ]["choices"]
    assert all(d["cached_tokens"] > 0 for d in details[1:])


def test_prompt_logprobs_field_in_vllms_shape(tiny_server, tiny):
    ids = tiny.tokenizer(PROMPT)["input_ids"]
    body = tiny_server.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}
    ).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    ref = _log_softmax(tiny, ids)
    for i, entry in enumerate(plp[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-4)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[i + 1]) or v["rank"] is not None)
        assert ranks[:2] == [1, 2] and not math.isnan(own["logprob"])


def test_streamed_echo_and_logprobs_add_up_to_the_whole_response(client, tiny):
    whole = client.completions.create(model=None, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0)
    text, tokens, values = "", [], []
    for chunk in client.completions.create(
        model=None, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert text == whole.choices[0].text and text.startswith(PROMPT)
    assert tokens == whole.choices[0].logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-6)
