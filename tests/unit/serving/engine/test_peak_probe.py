"""The startup peak probe and the per-step work counters, in a real Scheduler on the tiny-random model: the probe
returns sane machine numbers, and each step's FLOP and byte counters advance by the model's analytic count."""

from __future__ import annotations

import math

from serving.args import ServerArgs
from serving.engine.peak_probe import measure
from serving.engine.scheduler import Scheduler
from serving.engine.utilisation import ModelShape, chunk_pairs, step_work
from serving.ipc import Endpoints
from tests.helpers import encode, greedy


def test_the_probe_measures_positive_finite_sane_peaks():
    peak = measure(budget_s=0.01)
    assert math.isfinite(peak.flops) and 1e8 < peak.flops < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s on a CPU
    assert math.isfinite(peak.bytes_per_second) and 1e8 < peak.bytes_per_second < 1e13


def _work(sched: Scheduler) -> dict[str, tuple[float, float]]:
    stats = sched.stats()
    return {f.phase: (f.count, b.count) for f, b in zip(stats["work_flops"], stats["work_bytes"])}


def test_a_steps_counters_advance_by_the_models_numbers(tiny, tmp_path):
    sched = Scheduler(ServerArgs(model="tiny-random", dtype="float32"), Endpoints.create(str(tmp_path)))
    try:
        shape = ModelShape.from_hf_config(tiny.hf_model.config)  # float32: weights, KV and activations 4 bytes
        ids = encode(tiny, "Hello there, how are you")
        sched.core.add_request("r", ids, greedy(3, ignore_eos=True))
        p = len(ids)
        # the whole prompt in one chunk (one token sampled), then one decode attending to p + 1 positions
        for phase, want in (
            ("prefill", step_work(shape, p, 1, chunk_pairs(0, p), 0)),
            ("decode", step_work(shape, 1, 1, p + 1, p)),
        ):
            before = _work(sched)
            events = sched.core.step()
            sched.observers.ran(sched.core.last_step, events)
            after = _work(sched)
            assert after[phase][0] - before[phase][0] == want.flops > 0
            assert math.isclose(after[phase][1] - before[phase][1], want.bytes)
            other = "decode" if phase == "prefill" else "prefill"
            assert after[other] == before[other]
        stats = sched.make_stats()
        assert stats.peak_flops > 0 and stats.peak_bytes_per_second > 0
        assert [w.phase for w in stats.work_flops] == ["prefill", "decode"]
    finally:
        sched.close()


def test_no_peak_probe_leaves_the_gauges_at_zero(tmp_path):
    sched = Scheduler(
        ServerArgs(model="tiny-random", dtype="float32", peak_probe=False), Endpoints.create(str(tmp_path))
    )
    try:
        stats = sched.make_stats()
        assert stats.peak_flops == 0 and stats.peak_bytes_per_second == 0
    finally:
        sched.close()
