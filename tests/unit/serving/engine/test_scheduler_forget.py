"""Every way a request ends in the Scheduler process leaves none of its per-request tables behind:
its envelope (trace carrier, detokenizer parameters, worker, trace id for the step timeline), its
CPU ledger entry, its stage-span context, the engine's record; and its ending is remembered for
attributing late messages (stale drops)."""

from __future__ import annotations

import pytest

from protocol.io_struct import AbortReq, DetokParams, ReqMeta, TokenizedGenerateReqInput
from serving.args import ServerArgs
from serving.engine.forward_pass import FAULT_SEED_ENV
from serving.engine.scheduler import Scheduler
from serving.ipc import Endpoints
from tests.helpers import encode, greedy

TRACE = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


@pytest.fixture
def sched(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_SEED_ENV, "666")
    s = Scheduler(ServerArgs(model="tiny-random", dtype="float32", max_queue_time=5.0), Endpoints.create(str(tmp_path)))
    monkeypatch.setattr(s, "send_outputs", lambda: None)  # no Detokenizer here: the outputs stay in the outbox
    yield s
    s.close()


def _add(sched, tiny, rid: str, n: int = 3, **kw) -> None:
    params = greedy(n, ignore_eos=True, **kw)
    sched._add(
        TokenizedGenerateReqInput(
            rid=rid,
            input_ids=encode(tiny, "Hello there"),
            sampling=params,
            detok=DetokParams(),
            meta=ReqMeta(trace=dict(TRACE)),
            worker=1,
        )
    )
    assert sched.outputs.reqs[rid].trace_id and rid in sched.spans.ctx  # the tables it fills


def _run(sched) -> None:
    while sched.core.has_work:
        sched.step()  # the process's step: the engine's, the CPU charged, the outputs built


def _assert_forgotten(sched, rid: str, ending: str) -> None:
    tables = {
        "envelopes": sched.outputs.reqs,
        "cpu": sched.cpu.ns,
        "span contexts": sched.spans.ctx,
        "engine": sched.core.reqs,
    }
    left = [name for name, table in tables.items() if rid in table]
    assert not left, f"{rid} is still in {left}"
    assert sched.drops.drop("TokenOut", rid) == ending  # a late message for it is attributed to how it ended
    last = sched.outputs.outbox[-1]
    assert last.rid == rid and last.finish_reason is not None


def test_finished(sched, tiny):
    _add(sched, tiny, "done")
    _run(sched)
    _assert_forgotten(sched, "done", "length")


def test_aborted_running_and_stop_string(sched, tiny):
    for rid, reason, ending in (("cut", "client_disconnect", "abort"), ("stopped", "stop_string", "abort")):
        _add(sched, tiny, rid, n=20)
        sched.step()
        sched._abort(AbortReq(rid=rid, reason=reason))
        _assert_forgotten(sched, rid, ending)


def test_engine_error(sched, tiny):
    _add(sched, tiny, "faulty", seed=666)  # the fault seam fails every step that includes it
    _run(sched)
    assert sched.outputs.outbox[-1].finish_reason == "error"
    _assert_forgotten(sched, "faulty", "error")


def test_timed_out_in_the_queue(sched, tiny):
    _add(sched, tiny, "late")
    sched.core.reqs["late"].times.queued -= int(10e9)  # it has waited past --max-queue-time
    sched.expire_queue()
    _assert_forgotten(sched, "late", "abort")


def test_its_output_could_not_be_built(sched, tiny, monkeypatch):
    _add(sched, tiny, "broken")

    def fail(rid, meta):
        raise RuntimeError("cannot encode")

    monkeypatch.setattr(sched.spans, "first_output", fail)
    _run(sched)
    assert sched.outputs.outbox[-1].finish_reason == "error" and sched.outputs.outbox[-1].worker == 1
    _assert_forgotten(sched, "broken", "error")


def test_its_worker_died(sched, tiny):
    _add(sched, tiny, "orphan", n=20)
    sched.step()
    sched.outputs.outbox.clear()
    sched._worker_gone(1)
    assert not sched.outputs.outbox  # no one is left to hear about it
    assert "orphan" not in sched.outputs.reqs and "orphan" not in sched.spans.ctx and "orphan" not in sched.cpu.ns
    assert sched.drops.drop("TokenOut", "orphan") == "worker_gone"
