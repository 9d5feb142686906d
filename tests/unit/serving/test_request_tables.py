"""Every way a request ends leaves nothing of it behind in any of the three processes: the
TokenizerManager's `rid_to_state`, admission and rank loads; the Detokenizer's records and spans;
the Scheduler's envelopes, CPU ledger, span contexts, embeddings groups and the engine's queues,
records and KV.  The endings: finish, an operator's abort, a stop string (the Detokenizer ends it,
the TokenizerManager aborts it in the engine), an engine error, a deadline (the TokenizerManager's
and the Scheduler's queue limit), a client that goes away mid-stream, and retraction (a KV pool too
small, so requests leave the batch and come back) followed by a normal finish.

The three are the real objects (the tiny-random model, its tokenizer, the wire codec on every hop),
joined in memory by `Pipeline` instead of ZMQ sockets, so each table can be read between messages.
"""

from __future__ import annotations

import asyncio

import pytest

from protocol.io_struct import AbortReq, BatchStrOutput, BatchTokenIDOutput, Message
from protocol.reasons import AbortReason
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.detokenizer.manager import DetokenizerManager
from serving.engine.forward_pass import FAULT_SEED_ENV
from serving.engine.scheduler import Scheduler
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState
from serving.ipc import Codec, Endpoints
from telemetry.clock import now_ns
from tests.unit.serving.frontend.front import Front, ready_front, tokenizer

FAULT_SEED = 666
PROMPT = list(range(100, 116))  # 16 token ids


class Wire:
    """A PUSH socket's stand-in: what the Scheduler sends is kept, encoded, to be delivered."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.frames.append(data)

    def take(self) -> list[bytes]:
        frames, self.frames = self.frames, []
        return frames


class Pipeline:
    """TokenizerManager → Scheduler → Detokenizer → TokenizerManager, one message at a time."""

    def __init__(self, tmp_path, **sched_flags) -> None:
        self.front: Front = ready_front()
        self.sched = Scheduler(
            ServerArgs(model="tiny-random", dtype="float32", **sched_flags), Endpoints.create(str(tmp_path))
        )
        self.sched.to_detok, self.sched.to_tm = Wire(), Wire()
        self.detok = DetokenizerManager(tokenizer())
        self.codec = Codec("pipeline")
        self.to_scheduler: list[Message] = []  # every message the TokenizerManager sent, in order

    @property
    def tm(self):
        return self.front.tm

    async def submit(self, max_new_tokens: int = 8, prompt: list[int] | None = None, **kw) -> ReqState:
        sampling = SamplingParams(temperature=0.0, ignore_eos=True, seed=kw.pop("seed", None))
        obj = GenerateReqInput(sampling=sampling, prompt=prompt or PROMPT, max_new_tokens=max_new_tokens, **kw)
        return await self.tm.submit(obj, ReqState(route="/generate", operation="generate", arrival=now_ns()))

    def pump(self, steps: int | None = None) -> None:
        """Deliver every message in flight, stepping the engine (at most `steps` times) until nothing moves."""
        while True:
            sent, self.front.transport.sent = self.front.transport.sent, []
            for msg in sent:
                self.to_scheduler.append(msg)
                self.sched.on_message(msg)
            stepped = self.sched.core.has_work and (steps is None or steps > 0)
            if stepped:
                self.sched.step()
                steps = None if steps is None else steps - 1
            self.sched.send_outputs()
            frames = self.sched.to_detok.take()
            for data in frames:
                batch = self.codec.decode(data)
                assert isinstance(batch, BatchTokenIDOutput)
                self.front.transport.deliver(BatchStrOutput(outputs=self.detok.handle_batch(batch).outputs))
            if not (sent or stepped or frames):
                return

    def assert_empty(self) -> None:
        s, d, tm = self.sched, self.detok, self.tm
        tables = {
            "tm.rid_to_state": tm.rid_to_state,
            "tm.rank_picker.load": [n for n in tm.rank_picker.load if n],
            "tm.admission": [n for n in (tm.admission.num_queued, tm.admission.inflight_tokens) if n],
            "detok.reqs": d.reqs,
            "detok.spans": d.spans.rids,
            "sched.outputs": s.outputs.reqs,
            "sched.outbox": s.outputs.outbox,
            "sched.cpu": s.cpu.ns,
            "sched.spans": s.spans.ctx,
            "sched.embeds": s.embeds.groups,
            "engine.reqs": s.core.reqs,
            "engine.running": s.core.running,
            "engine.waiting": list(s.core.waiting),
        }
        left = {name: table for name, table in tables.items() if table}
        assert not left, f"left behind: {left}"
        assert s.core.pool.is_idle()
        s.core.check_kv_invariants()


def _ended(state: ReqState) -> tuple[str | None, int, str]:
    text = "".join(o.text for o in state.out_list)
    return state.finish_reason, state.status, text


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_SEED_ENV, str(FAULT_SEED))  # read when the engine starts
    p = Pipeline(tmp_path_factory.mktemp("pipeline"), max_queue_time=5.0)
    mp.undo()
    yield p
    p.sched.close()


def test_finished(pipe):
    async def body():
        st = await pipe.submit(6)
        _ends_as(pipe, st, "length", 200)
        assert st.completion_tokens == 6

    asyncio.run(body())


async def _running(pipe: Pipeline, **kw) -> ReqState:
    """A request that has produced its first tokens and runs on."""
    st = await pipe.submit(20, **kw)
    pipe.pump(steps=2)
    assert not st.finished and st.rid in pipe.sched.core.reqs
    return st


def _ends_as(pipe: Pipeline, st: ReqState, finish_reason: str, status: int) -> None:
    """Everything in flight delivered: it ended as said, and nothing of it is left anywhere."""
    pipe.pump()
    assert (st.finish_reason, st.status) == (finish_reason, status)
    pipe.assert_empty()


def test_aborted_by_an_operator(pipe):
    async def body():
        st = await _running(pipe)
        pipe.tm.abort_all(AbortReason.OPERATOR, "paused")
        _ends_as(pipe, st, "abort", 503)

    asyncio.run(body())


def test_stop_string_ends_it_in_the_engine_too(pipe):
    async def body():
        free = await pipe.submit(12)
        pipe.pump()
        text = _ended(free)[2]
        stop = text[len(text) // 4 : len(text) // 4 + 3]
        assert stop.strip(), text
        st = await pipe.submit(12, stop=[stop])
        pipe.pump()
        finish, status, got = _ended(st)
        assert (finish, status) == ("stop", 200) and got == text[: text.index(stop)]
        assert any(
            isinstance(m, AbortReq) and m.reason == AbortReason.STOP_STRING and m.rid == st.rid
            for m in pipe.to_scheduler
        ), "the Scheduler was not told to stop it"
        pipe.assert_empty()

    asyncio.run(body())


def test_engine_error(pipe):
    async def body():
        st = await pipe.submit(6, seed=FAULT_SEED)  # the fault seam fails every step that includes it
        ok = await pipe.submit(6)
        pipe.pump()
        assert (st.finish_reason, st.status) == ("error", 500) and st.out_list[-1].error
        assert (ok.finish_reason, ok.completion_tokens) == ("length", 6)  # its batch mate is unaffected
        pipe.assert_empty()

    asyncio.run(body())


def test_deadline_in_the_front_end(pipe):
    async def body():
        st = await _running(pipe, timeout=0.05)
        await asyncio.sleep(0.1)  # clock: the request's own 50 ms deadline passes
        _ends_as(pipe, st, "abort", 504)

    asyncio.run(body())


def test_timed_out_in_the_engine_queue(pipe):
    async def body():
        st = await pipe.submit(6)
        sent, pipe.front.transport.sent = pipe.front.transport.sent, []
        for msg in sent:
            pipe.sched.on_message(msg)
        pipe.sched.core.reqs[st.rid].times.queued -= int(10e9)  # it has waited past --max-queue-time
        pipe.sched.expire_queue()
        _ends_as(pipe, st, "abort", 504)
        assert "queue" in st.out_list[-1].error

    asyncio.run(body())


def test_client_went_away_mid_stream(pipe):
    async def body():
        st = await _running(pipe)
        reader = pipe.tm.stream(st)
        assert (await reader.__anext__()).output_ids
        await reader.aclose()  # the reader's `finally` aborts it
        _ends_as(pipe, st, "abort", 499)

    asyncio.run(body())


def test_retracted_then_finished(tmp_path):
    async def body():
        pipe = Pipeline(tmp_path, max_total_tokens=200)  # admitted on an estimate, 6 x (16 + 60) slots do not fit
        try:
            states = [await pipe.submit(60, prompt=[t + i for t in PROMPT]) for i in range(6)]
            pipe.pump()
            assert pipe.sched.core.retractions > 0
            assert [(s.finish_reason, s.completion_tokens) for s in states] == [("length", 60)] * 6
            assert max(s.retractions for s in states) > 0
            pipe.assert_empty()
        finally:
            pipe.sched.close()

    asyncio.run(body())
