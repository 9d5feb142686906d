"""The OpenAI-compatible API end to end: real processes, real ZMQ, real HTTP (tiny-random)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from serving.engine.utilisation import ModelShape, step_work
from tests.helpers import PROMPTS, collect, encode, greedy, make_core
from tests.server_util import (
    HOLD,
    chat_ids,
    chat_text,
    completion_text,
    push_frames,
    scrape,
    sse_events,
    stream,
    value,
    wait_until,
)


def engine_text(model, ids: list[int], n: int) -> str:
    """What the in-process engine produces for the same greedy request."""
    core = make_core(model)
    core.add_request("ref", ids, greedy(n))
    return model.tokenizer.decode(collect(core)["ref"], skip_special_tokens=True)


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_completion_stream_equals_nonstream_equals_engine(tiny_server, tiny, prompt):
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = tiny_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    full = r.json()
    events = stream(tiny_server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    expected = engine_text(tiny, encode(tiny, prompt), 24)
    assert full["choices"][0]["text"] == completion_text(events) == expected
    assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
    n_prompt = len(encode(tiny, prompt))
    cached = full["usage"]["prompt_tokens_details"]["cached_tokens"]  # > 0 when an earlier test sent this prompt
    assert (
        full["usage"]
        == {
            "prompt_tokens": n_prompt,
            "completion_tokens": 24,
            "total_tokens": n_prompt + 24,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        and 0 <= cached < n_prompt
    )
    finals = [e["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert r.headers["x-request-id"] in full["id"]


def test_chat_stream_shape_matches_openai(tiny_server, tiny):
    body = {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events = stream(tiny_server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    ids = chat_ids(tiny, "Say hi")
    assert usage_chunk["usage"]["prompt_tokens"] == len(ids)
    non_stream = tiny_server.post("/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"})
    msg = non_stream.json()["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert msg["content"] == chat_text(chunks) == engine_text(tiny, ids, 12)


def test_32_concurrent_streams_each_match_their_solo_text(tiny_server):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(32)]
    solo = {}
    for p in prompts[:32]:
        r = tiny_server.post("/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0})
        solo[p] = r.json()["choices"][0]["text"]

    async def one(client: httpx.AsyncClient, p: str) -> str:
        body = {"prompt": p, "max_tokens": 16, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return completion_text(events)

    async def main():
        async with httpx.AsyncClient(
            base_url=tiny_server.url, timeout=120, limits=httpx.Limits(max_connections=64)
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert results == [solo[p] for p in prompts]


def test_stop_strings_trim_exactly(tiny_server):
    base = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0}
    text = tiny_server.post("/v1/completions", base).json()["choices"][0]["text"]
    assert len(text) > 20
    stop = text[12:16]
    cut = text[: text.index(stop)]
    r = tiny_server.post("/v1/completions", {**base, "stop": ["zzzz-never", stop]}).json()
    assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
    events = stream(tiny_server, "/v1/completions", {**base, "stop": stop})
    assert completion_text(events) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    gen = tiny_server.post(
        "/generate", {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 40, "temperature": 0, "stop": stop}}
    ).json()
    assert gen["text"] == cut and gen["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert gen["meta_info"]["completion_tokens"] < 40


def test_generate_endpoint_text_and_input_ids(tiny_server, tiny):
    ids = encode(tiny, PROMPTS[0])
    by_text = tiny_server.post(
        "/generate", {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ).json()
    by_ids = tiny_server.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ).json()
    assert by_text["output_ids"] == by_ids["output_ids"] and len(by_ids["output_ids"]) == 10
    assert by_text["text"] == tiny.tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    events = stream(
        tiny_server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    )
    assert events[-1] == "[DONE]" and events[-2]["text"] == by_ids["text"]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length"}


def test_models_and_health(tiny_server):
    models = httpx.get(tiny_server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-random"
    assert models["data"][0]["object"] == "model" and models["data"][0]["owned_by"]
    assert (models["data"][0]["dtype"], models["data"][0]["quantization"]) == ("float32", "none")
    assert "OpenMP wait: OMP_WAIT_POLICY=PASSIVE" in tiny_server.log()  # --thread-wait-policy reached the Scheduler
    h = httpx.get(tiny_server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    live = httpx.get(tiny_server.url + "/livez")  # liveness: the event loop answers, whatever the engine does
    assert live.status_code == 200 and live.json() == {"status": "alive"}


def test_engine_info_and_step_phases_reach_metrics(tiny_server, tiny):
    tiny_server.barrier()
    before = scrape(tiny_server)
    r = tiny_server.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    p = r.json()["usage"]["prompt_tokens"]
    tiny_server.barrier()  # the Scheduler's stats of those steps are in
    text = scrape(tiny_server)
    assert (
        value(
            text,
            "sightline_engine_info",
            dtype="float32",
            quantization="none",
            model_name="tiny-random",
            architecture="LlamaForCausalLM",
        )
        == 1
    )
    for phase in ("schedule", "forward", "sample", "output"):
        count = value(text, "sightline_engine_step_phase_seconds_count", phase=phase)
        total = value(text, "sightline_engine_step_phase_seconds_sum", phase=phase)
        inf = value(text, "sightline_engine_step_phase_seconds_bucket", phase=phase, le="+Inf")
        steps = count - value(before, "sightline_engine_step_phase_seconds_count", phase=phase)
        assert steps == 4 and inf == count and total > 0, (phase, steps)  # a prefill and three decodes
    forward = value(text, "sightline_engine_step_phase_seconds_sum", phase="forward")
    assert forward > value(text, "sightline_engine_step_phase_seconds_sum", phase="schedule")
    # the steps' work: three decodes after the prompt, counted exactly as the model's shape says; the machine's peak
    shape = ModelShape.from_hf_config(tiny.hf_model.config)
    decodes = sum(step_work(shape, 1, 1, p + k + 1, p + k).flops for k in range(3))
    for name, want in (("sightline_engine_flops_total", decodes), ("sightline_engine_bytes_total", None)):
        grew = value(text, name, phase="decode") - value(before, name, phase="decode")
        assert grew > 0 and (want is None or math.isclose(grew, want, rel_tol=1e-9)), (name, grew, want)
        assert value(text, name, phase="prefill") >= value(before, name, phase="prefill")
    for peak in ("sightline_machine_peak_flops", "sightline_machine_peak_bytes_per_second"):
        assert value(text, peak) > 1e8, peak


def test_client_disconnect_frees_kv_and_counts_late_outputs(tiny_server):
    """A held stream (certainly running) whose client hangs up: its KV is freed within a second, and
    the abort's final output, arriving after the front end forgot the rid, is counted as a stale drop."""
    import time

    def drops() -> int:
        return sum(d[3] for d in tiny_server.debug()["stale_drops"] if d[0] == "tokenizer_manager")

    tiny_server.barrier()
    before = drops()
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True, **HOLD}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        tiny_server.wait_held(1)  # seven tokens sent, the request running
        sched = tiny_server.debug()["scheduler"]
        assert sched["num_running"] == 1 and sched["kv_used"] > sched["prefix_cached_tokens"], sched
    t0 = time.monotonic()  # the connection is closed here

    def freed() -> bool:
        tiny_server.barrier()
        sched = tiny_server.debug()["scheduler"]
        return (
            sched["num_running"] == 0
            and sched["kv_used"] == sched["prefix_cached_tokens"]
            and sched["kv_reserved"] == 0
            and sched["held"] == 0
        )

    wait_until(freed, 5, f"the KV of {rid} freed")
    freed_after = time.monotonic() - t0
    assert freed_after < 1.0, f"KV freed only after {freed_after:.2f} s ({rid}): {tiny_server.debug()}"
    tiny_server.barrier()  # the abort's final output has been through the Detokenizer to the front end
    state = tiny_server.debug()
    assert drops() == before + 1, state["stale_drops"]
    assert any(d[:3] == ["tokenizer_manager", "BatchStrOutput", "client_disconnect"] for d in state["stale_drops"])
    assert state["in_flight"] == 0
    ok = tiny_server.post("/v1/completions", {"prompt": "next", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_undecodable_message_is_counted_and_the_loop_survives(tiny_server):
    tiny_server.barrier()
    before = tiny_server.debug()["undecodable"]["scheduler"]
    push_frames(
        tiny_server.runtime_dir,
        "scheduler",
        b"\x93not-a-message",
        json.dumps({"type": "Evil", "payload": "__reduce__"}).encode(),
    )

    def counted() -> int:  # our socket is not the front end's: a barrier alone may pass ahead of the frames
        tiny_server.barrier()
        return tiny_server.debug()["undecodable"]["scheduler"] - before

    assert wait_until(lambda: counted() >= 2, 10, "the two frames counted as undecodable")
    assert counted() == 2
    assert tiny_server.post("/v1/completions", {"prompt": "still alive", "max_tokens": 3}).status_code == 200
