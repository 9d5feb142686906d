"""The TokenizerManager without processes: admission, validation, outputs, finish, abort
and stale drops, driven through an in-memory transport (tests/unit/front.py)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.io_struct import AbortReq, FlushCacheReq, FlushCacheReqOutput, TokenizedGenerateReqInput
from protocol.sampling_params import SamplingParams
from serving.frontend.errors import APIError
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState
from tests.unit.serving.frontend.front import CONTEXT, make_front, ready_front, tokenizer


def run(coro):
    return asyncio.run(coro)


def test_submit_sends_the_tokenized_request_under_a_fresh_rid():
    async def body():
        f = ready_front()
        state = await f.submit("Hello world", max_new_tokens=5, rid="client-1")
        (msg,) = f.transport.sent
        assert isinstance(msg, TokenizedGenerateReqInput)
        assert msg.rid == state.rid != "client-1" and state.client_rid == "client-1"
        assert msg.input_ids == tokenizer()("Hello world")["input_ids"]
        assert msg.sampling.max_new_tokens == 5 and msg.detok.prompt_tail == msg.input_ids[-5:]
        assert msg.meta.stamps.arrival == state.arrival and msg.meta.stamps.tokenized >= state.arrival
        assert f.tm.rid_to_state == {state.rid: state}
        expected = len(msg.input_ids) + round(0.7 * 5)  # the prompt + the Scheduler's first estimate of its output
        assert (f.tm.admission.num_queued, f.tm.admission.inflight_tokens) == (1, expected)
        again = await f.submit("Hello world", max_new_tokens=5, rid="client-1")
        assert again.rid != state.rid  # a reused client rid never routes to the old request

    run(body())


def test_nothing_is_accepted_before_the_engine_is_ready():
    async def body():
        f = make_front()
        with pytest.raises(APIError) as err:
            await f.submit()
        assert err.value.status == 503 and not f.transport.sent

    run(body())


@pytest.mark.parametrize(
    "kw, status, code_or_param",
    [
        ({"prompt": ""}, 400, "empty_prompt"),
        ({"prompt": "word " * 400}, 400, "context_length_exceeded"),
        ({"max_new_tokens": CONTEXT}, 400, "context_length_exceeded"),
        ({"rid": "has space"}, 400, "rid"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_sent(kw, status, code_or_param):
    async def body():
        f = ready_front()
        with pytest.raises(APIError) as err:
            await f.submit(**kw)
        assert err.value.status == status and code_or_param in (err.value.code, err.value.param)
        assert not f.transport.sent and not f.tm.rid_to_state
        assert (f.tm.admission.num_queued, f.tm.admission.inflight_tokens) == (0, 0)

    run(body())


def test_a_sampling_error_names_the_api_field():
    async def body():
        f = ready_front()
        obj = GenerateReqInput(
            sampling=SamplingParams(top_k=2**63), prompt="hi", max_new_tokens=4, param_names={"top_k": "top_k"}
        )
        with pytest.raises(APIError) as err:
            await f.tm.submit(obj, ReqState(route="/generate", operation="generate", arrival=0))
        assert err.value.status == 400 and err.value.param == "top_k"

    run(body())


def test_full_queue_and_full_token_budget_answer_429_with_retry_after():
    async def body():
        f = ready_front(max_queued_requests=2, max_inflight_tokens=30)
        await f.submit(max_new_tokens=8)  # expected: ~6 prompt + 0.7 x 8
        with pytest.raises(APIError) as err:  # ~6 prompt + 0.7 x 30 > 30 - 12 in flight
            await f.submit(max_new_tokens=30)
        assert err.value.status == 429 and err.value.code == "tokens_full"
        assert 1 <= int(err.value.headers["retry-after"]) <= 60
        await f.submit(max_new_tokens=8)
        with pytest.raises(APIError) as err:
            await f.submit(max_new_tokens=1)
        assert err.value.code == "queue_full"
        assert f.sample("sightline_requests_shed_total", model_name="tiny-random", reason="queue_full") == 1
        assert f.sample("sightline_requests_shed_total", model_name="tiny-random", reason="tokens_full") == 1
        assert len(f.transport.sent) == 2

    run(body())


def test_outputs_stream_in_order_and_finishing_releases_everything():
    async def body():
        f = ready_front()
        state = await f.submit(max_new_tokens=3)
        f.output(state, " Paris", [3, 4])
        assert f.tm.admission.num_queued == 0  # started: no longer queued
        f.output(state, ".", [5], finish_reason="length")
        got = [(o.text, o.output_ids, o.finish_reason) async for o in f.tm.stream(state)]
        assert got == [(" Paris", [3, 4], None), (".", [5], "length")]
        assert state.finished and state.status == 200 and not f.tm.rid_to_state
        assert (f.tm.admission.num_queued, f.tm.admission.inflight_tokens) == (0, 0)
        assert state.breakdown["ttft_ms"] is not None and state.completion_tokens == 3
        assert (
            f.sample(
                "sightline_requests_total",
                model_name="tiny-random",
                finish_reason="length",
                status="200",
                outcome="length",
            )
            == 1
        )
        route = {"model_name": "tiny-random", "route": "/v1/completions"}  # the route the request came in on
        assert f.sample("sightline_time_to_first_token_seconds_count", **route) == 1
        assert f.sample("sightline_inter_token_latency_seconds_count", **route) == 1
        assert not any(isinstance(m, AbortReq) for m in f.transport.sent)

    run(body())


def test_a_reader_that_leaves_aborts_down_to_the_scheduler_and_late_outputs_are_stale():
    async def body():
        f = ready_front()
        state = await f.submit(max_new_tokens=8)
        f.output(state, " a", [7])
        stream = f.tm.stream(state)
        assert (await anext(stream)).text == " a"
        await stream.aclose()  # the client went away
        abort = f.transport.sent[-1]
        assert isinstance(abort, AbortReq) and abort.rid == state.rid and abort.reason == "client_disconnect"
        assert state.status == 499 and not f.tm.rid_to_state
        f.output(state, " b", [8])  # already in flight when the abort was sent
        drops = [(d.component, d.message_type, d.reason, d.count) for d in f.tm.drops.snapshot()]
        assert drops == [("tokenizer_manager", "BatchStrOutput", "client_disconnect", 1)]
        assert (
            f.sample(
                "sightline_stale_messages_dropped_total",
                component="tokenizer_manager",
                message_type="BatchStrOutput",
                reason="client_disconnect",
            )
            == 1
        )
        assert f.sample("sightline_request_aborts_total", model_name="tiny-random", reason="client_disconnect") == 1

    run(body())


def test_an_output_for_a_rid_never_seen_is_dropped_as_unknown():
    async def body():
        f = ready_front()
        state = await f.submit()
        state.rid = "not-ours"
        f.output(state, "x", [1])
        assert [d.reason for d in f.tm.drops.snapshot()] == ["unknown_rid"]

    run(body())


def test_a_stop_string_while_the_engine_still_runs_frees_its_kv():
    async def body():
        f = ready_front()
        state = await f.submit()
        f.output(state, "done", [9], finish_reason="stop", matched_stop="\n", abort_in_engine=True)
        abort = f.transport.sent[-1]
        assert isinstance(abort, AbortReq) and abort.reason == "stop_string" and state.status == 200

    run(body())


def test_a_timeout_ends_the_request_with_504_and_tells_the_scheduler():
    async def body():
        f = ready_front()
        state = await f.submit(timeout=0.05)
        outs = [o async for o in f.tm.stream(state)]
        assert outs[-1].finish_reason == "abort" and "timed out" in outs[-1].error
        assert state.status == 504 and isinstance(f.transport.sent[-1], AbortReq)
        assert f.transport.sent[-1].reason == "timeout"

    run(body())


def test_one_bad_output_ends_that_request_alone(monkeypatch):
    async def body():
        f = ready_front()
        bad, good = await f.submit(), await f.submit()
        real = f.tm.tel.on_output

        def on_output(rt, out, recv):
            if rt is bad:
                raise RuntimeError("boom")
            real(rt, out, recv)

        monkeypatch.setattr(f.tm.tel, "on_output", on_output)
        f.output(bad, "x", [1])
        f.output(good, "y", [2], finish_reason="length")
        assert bad.status == 500 and bad.finish_reason == "abort"
        assert good.status == 200 and good.finish_reason == "length"
        assert f.tm.handling_errors.count == 1
        assert f.sample("sightline_message_handling_errors_total", component="tokenizer_manager") == 1

    run(body())


def test_engine_failure_ends_every_request_with_an_error_and_forgets_the_engine():
    async def body():
        f = ready_front()
        states = [await f.submit() for _ in range(3)]
        f.tm.abort_all("engine_failure", "the engine failed")
        f.tm.reset_engine()
        assert all(s.status == 503 and s.out_list[-1].error == "the engine failed" for s in states)
        assert not f.tm.rid_to_state and f.transport.reconnects == 1 and not f.monitor.all_ready.is_set()
        with pytest.raises(APIError) as err:
            await f.submit()
        assert err.value.status == 503

    run(body())


def test_shutdown_ends_in_flight_requests_with_the_shutdown_outcome():
    async def body():
        f = ready_front()
        states = [await f.submit() for _ in range(2)]
        f.tm.abort_all("shutdown", "the server is shutting down")
        assert all(s.status == 503 for s in states)
        assert (
            f.sample(
                "sightline_requests_total",
                model_name="tiny-random",
                finish_reason="abort",
                status="503",
                outcome="shutdown",
            )
            == 2
        )
        assert (
            f.sample(
                "sightline_requests_total",
                model_name="tiny-random",
                finish_reason="abort",
                status="503",
                outcome="engine_failure",
            )
            == 0
        )

    run(body())


def test_a_message_that_is_not_for_the_front_end_counts_as_unexpected():
    async def body():
        f = ready_front()
        f.transport.deliver(AbortReq(rid="x", reason="r"))
        assert f.transport.codec.undecodable == 1
        assert f.sample("sightline_undecodable_messages_total", component="tokenizer_manager") == 1

    run(body())


def test_flush_cache_waits_for_the_schedulers_answer_and_a_late_answer_is_stale():
    async def body():
        f = ready_front()
        task = asyncio.create_task(f.tm.flush_cache(force=True))
        await asyncio.sleep(0)
        (msg,) = f.transport.sent
        assert isinstance(msg, FlushCacheReq) and msg.force
        f.transport.deliver(FlushCacheReqOutput(id=msg.id, success=True, flushed_tokens=42))
        reply = await task
        assert reply.success and reply.flushed_tokens == 42 and not f.tm._flushes
        with pytest.raises(asyncio.TimeoutError):
            await f.tm.flush_cache(force=False, timeout=0.01)
        late = f.transport.sent[-1]
        f.transport.deliver(FlushCacheReqOutput(id=late.id, success=False, message="requests are running"))
        assert [(d.message_type, d.reason) for d in f.tm.drops.snapshot()] == [("FlushCacheReqOutput", "unknown_rid")]

    run(body())
