"""The TokenizerManager's embeddings path with everything real but the sockets: what it sends, what it
refuses, how an `EmbeddingOut` (or an error) finishes the request, the metrics by kind, the tenant's
limits, the post-processing of the vectors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from protocol.io_struct import (
    BatchEmbeddingOutput,
    BatchStrOutput,
    EmbeddingOut,
    Ready,
    ReqMeta,
    Stamps,
    StrOut,
    TokenizedEmbeddingReqInput,
)
from protocol.sampling_params import SamplingParams
from serving.frontend.errors import APIError
from serving.frontend.http.routes.embeddings import input_list
from serving.frontend.tokenizer_manager import embeddings
from serving.frontend.tokenizer_manager.embeddings import EmbedReqInput, finish_vectors
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState
from telemetry.clock import now_ns
from tests.unit.serving.frontend.front import CONTEXT, VOCAB, Proc, make_front


def front_serving(pooling: str = "mean", embedding_only: bool = False, **flags):
    front = make_front(**flags)
    front.procs = {"scheduler": Proc(101), "detokenizer": Proc(102)}
    front.monitor.expect(front.procs)
    front.transport.deliver(
        Ready(
            role="scheduler",
            pid=101,
            context_len=CONTEXT,
            vocab_size=VOCAB,
            pooling=pooling,
            embedding_only=embedding_only,
            normalize=True,
            hidden_size=4,
        )
    )
    front.transport.deliver(Ready(role="detokenizer", pid=102))
    return front


def state() -> ReqState:
    return ReqState(route="/v1/embeddings", operation="embeddings", arrival=now_ns())


def vec(*values: float) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def test_one_message_for_every_input_and_the_answer_finishes_it():
    async def body():
        front = front_serving()
        st = await front.tm.submit_embeddings(EmbedReqInput(["hello world", [5, 6, 7]]), state())
        [msg] = front.transport.sent
        assert isinstance(msg, TokenizedEmbeddingReqInput) and msg.rid == st.rid and msg.pooling == "mean"
        assert msg.inputs[1] == [5, 6, 7] and st.prompt_tokens == sum(map(len, msg.inputs))
        t = now_ns()
        stamps = Stamps(
            arrival=st.arrival, tokenized=t, sched_recv=t, scheduled=t + 1000, waited=1000, finished=t + 5000
        )
        front.transport.deliver(
            BatchEmbeddingOutput(
                outputs=[
                    EmbeddingOut(
                        rid=st.rid,
                        embeddings=[vec(3, 4, 0, 0), vec(0, 0, 1, 0)],
                        dim=4,
                        prompt_tokens=st.prompt_tokens,
                        meta=ReqMeta(stamps=stamps),
                    )
                ]
            )
        )
        out, err = await embeddings.collect(front.tm.stream(st), st)
        assert err is None and st.finished and st.rid not in front.tm.rid_to_state
        v = finish_vectors(out, None, True)
        assert np.allclose(v[0], [0.6, 0.8, 0, 0]) and np.allclose(v[1], [0, 0, 1, 0])
        assert np.allclose(finish_vectors(out, 1, True)[0], [1.0])
        assert np.allclose(finish_vectors(out, 2, False)[0], [3, 4])
        model = {"model_name": "tiny-random"}
        route = {"route": "/v1/embeddings", **model}
        for kind in ("e2e", "queue", "prefill", "tokenize"):
            assert front.sample("sightline_embedding_request_latency_seconds_count", kind=kind, **route) == 1
        assert front.sample("sightline_embedding_request_latency_seconds_sum", kind="queue", **route) == 1e-6
        assert front.sample("sightline_embedding_request_size_sum", kind="inputs", **route) == 2
        assert front.sample("sightline_embedding_request_size_sum", kind="tokens", **route) == st.prompt_tokens
        assert (
            front.sample("sightline_requests_total", finish_reason="stop", status="200", outcome="stop", **model) == 1
        )
        assert front.sample("sightline_e2e_request_latency_seconds_count", **model) is None  # generation's only
        assert st.breakdown["inputs"] == 2 and st.breakdown["queue_ms"] == 0.001

    asyncio.run(body())


def test_an_error_from_the_engine_ends_the_request_with_it():
    async def body():
        front = front_serving()
        st = await front.tm.submit_embeddings(EmbedReqInput(["a"]), state())
        front.transport.deliver(
            BatchStrOutput(outputs=[StrOut(rid=st.rid, text="", output_ids=[], finish_reason="error", error="boom")])
        )
        out, err = await embeddings.collect(front.tm.stream(st), st)
        assert out is None and err.status == 500 and err.message == "boom"

    asyncio.run(body())


@pytest.mark.parametrize(
    "obj, code_or_param",
    [
        (EmbedReqInput([[1] * (CONTEXT + 1)]), "context_length_exceeded"),
        (EmbedReqInput(["a"] * 3), "too_many_inputs"),
        (EmbedReqInput([[]]), "empty_prompt"),
        (EmbedReqInput([[VOCAB]]), "invalid_token_id"),
        (EmbedReqInput(["a"], dimensions=5), "dimensions"),
        (EmbedReqInput(["a"], truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ],
)
def test_refusals_before_anything_is_sent(obj, code_or_param):
    async def body():
        front = front_serving(max_embedding_inputs=2)
        with pytest.raises(APIError) as exc:
            await front.tm.submit_embeddings(obj, state())
        assert exc.value.status == 400 and code_or_param in (exc.value.code, exc.value.param)
        assert front.transport.sent == [] and not front.tm.rid_to_state

    asyncio.run(body())


def test_truncation_keeps_the_last_tokens():
    async def body():
        front = front_serving()
        await front.tm.submit_embeddings(
            EmbedReqInput([list(range(1, CONTEXT + 10))], truncate_prompt_tokens=-1), state()
        )
        await front.tm.submit_embeddings(EmbedReqInput([list(range(1, 20))], truncate_prompt_tokens=4), state())
        assert front.transport.sent[0].inputs[0] == list(range(10, CONTEXT + 10))
        assert front.transport.sent[1].inputs[0] == [16, 17, 18, 19]

    asyncio.run(body())


def test_which_server_serves_what():
    async def body():
        gen = make_front()
        gen.ready()
        with pytest.raises(APIError) as exc:
            await gen.tm.submit_embeddings(EmbedReqInput(["a"]), state())
        assert exc.value.code == "embeddings_not_supported"
        only = front_serving(embedding_only=True)
        with pytest.raises(APIError) as exc:
            await only.tm.submit(
                GenerateReqInput(sampling=SamplingParams(), prompt="hi", max_new_tokens=2),
                ReqState(route="/v1/completions", operation="text_completion", arrival=now_ns()),
            )
        assert exc.value.code == "generation_not_supported"

    asyncio.run(body())


@pytest.mark.parametrize(
    "value, expected",
    [
        ("a", (["a"], False)),
        (["a", "b"], (["a", "b"], True)),
        ([1, 2], ([[1, 2]], False)),
        ([[1], [2, 3]], ([[1], [2, 3]], True)),
    ],
)
def test_input_forms(value, expected):
    assert input_list(value, "input") == expected


@pytest.mark.parametrize("value", [[], ["a", 1], [True], [[1], "a"], {"a": 1}])
def test_bad_input_forms(value):
    with pytest.raises(APIError):
        input_list(value, "input")
