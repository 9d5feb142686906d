"""The stats message is built from what computes each number: the engine's fields
(`SchedulerCore.stats`, the KV pool's included) and the Scheduler process's own
(`Scheduler.stats`), by field name.  Every `SchedulerStats` field must be filled by
exactly one of them, so a new engine number cannot silently stay at its default.  And the outputs the
process builds from the engine's events (`Outputs.emit`): logprobs per token, prompt logprobs once."""

from __future__ import annotations

import msgspec

from protocol.io_struct import DetokParams, ReqMeta, SchedulerStats, TokenizedGenerateReqInput
from serving.args import ServerArgs
from serving.engine.scheduler import Scheduler
from serving.ipc import Endpoints
from tests.helpers import encode, greedy


def test_every_stats_field_is_filled_by_one_source(tiny, tmp_path):
    sched = Scheduler(ServerArgs(model="tiny-random", dtype="float32"), Endpoints.create(str(tmp_path)))
    try:
        engine, process = set(sched.core.stats()), set(sched.stats())
        fields = {f.name for f in msgspec.structs.fields(SchedulerStats)} - {"sent_at"}  # stamped by the codec
        assert not engine & process, f"filled twice: {engine & process}"
        assert engine | process == fields, (
            f"never filled: {fields - engine - process}; unknown: {(engine | process) - fields}"
        )
        sched.core.add_request("r", encode(tiny, "Hello"), greedy(3, ignore_eos=True))
        sched.core.step()  # the engine alone: the process's counters stay at 0
        stats = sched.make_stats()
        pool = sched.core.pool
        assert (stats.kv_total, stats.kv_used, stats.kv_in_use) == (pool.capacity, pool.used_slots, pool.in_use)
        assert stats.kv_reserved == sched.core.kv_committed and stats.new_token_ratio == sched.core.policy.ratio
        assert (stats.batch_size, stats.num_running, stats.steps_total) == (1, 1, 0)
    finally:
        sched.close()


def test_outputs_carry_logprobs_and_the_prompt_logprobs_once(tiny, tmp_path):
    sched = Scheduler(ServerArgs(model="tiny-random", dtype="float32"), Endpoints.create(str(tmp_path)))
    try:
        ids = encode(tiny, "Hello there, how are you")
        sched._add(
            TokenizedGenerateReqInput(
                rid="r",
                input_ids=ids,
                sampling=greedy(3, ignore_eos=True, logprobs=2, prompt_logprobs=1),
                detok=DetokParams(),
                meta=ReqMeta(),
            )
        )
        while sched.core.has_work:
            for ev in sched.core.step():
                sched.outputs.emit(ev)
        outs = sched.outputs.outbox
        assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
        assert [len(o.logprobs.token_logprobs) for o in outs] == [1, 1, 1]
        assert all(o.logprobs.top_ids[0][0] == o.new_token_ids[0] for o in outs)  # greedy: its token on top
        first = outs[0].prompt_logprobs
        assert len(first.token_logprobs) == len(first.top_ids) == len(ids) - 1
        assert outs[1].prompt_logprobs is None and outs[2].prompt_logprobs is None
    finally:
        sched.close()
