"""The EngineMonitor without processes: Ready gating, heartbeats, health, the watchdog's
view, and the engine numbers /metrics shows."""

from __future__ import annotations

import asyncio
import time

from protocol.io_struct import DropCount, PhaseHistogram, Ready
from tests.unit.serving.frontend.front import Proc, make_front, ready_front


def test_only_the_children_just_spawned_may_report_ready_once():
    f = make_front()
    f.transport.deliver(Ready(role="scheduler", pid=101, context_len=64, vocab_size=10))  # nothing spawned yet
    assert f.monitor.ready_rejected == {"not_starting": 1}
    f.monitor.expect({"scheduler": Proc(101), "detokenizer": Proc(102)})
    f.transport.deliver(Ready(role="scheduler", pid=999, context_len=1, vocab_size=1))  # a stray writer
    assert f.monitor.ready_rejected == {"not_starting": 1, "wrong_pid": 1} and not f.monitor.ready
    f.transport.deliver(Ready(role="scheduler", pid=101, context_len=64, vocab_size=10))
    assert not f.monitor.all_ready.is_set() and f.monitor.health(None) == (False, "starting: waiting for detokenizer")
    f.transport.deliver(Ready(role="detokenizer", pid=102))
    assert f.monitor.all_ready.is_set() and f.monitor.engine_ready.context_len == 64
    f.transport.deliver(Ready(role="scheduler", pid=101, context_len=2, vocab_size=2))  # once per start
    assert f.monitor.engine_ready.context_len == 64 and f.monitor.ready_rejected["not_starting"] == 2
    assert f.transport.codec.undecodable == 3  # every refused Ready is counted as unexpected


def test_health_says_why_in_order_of_what_matters():
    f = ready_front(stall_timeout=0.05)
    assert f.monitor.health(None) == (True, "ok")
    assert f.monitor.health(time.monotonic_ns() - int(1e9))[1].startswith("engine stuck")
    f.scheduler_stats(last_token_at=time.monotonic_ns())
    assert f.monitor.health(time.monotonic_ns() - int(1e9)) == (True, "ok")  # a token just now
    f.procs["detokenizer"].alive, f.procs["detokenizer"].exitcode = False, -9
    assert f.monitor.health(None) == (False, "detokenizer process exited (code -9)")
    f.monitor.failed("detokenizer exited")
    f.monitor.restarting("restart attempt 1")
    assert f.monitor.health(None) == (False, "engine failure (detokenizer exited); restart attempt 1")
    f.monitor.give_up("engine down: budget spent")
    assert f.monitor.health(None) == (False, "engine down: budget spent")
    f.monitor.begin_shutdown()
    assert f.monitor.health(None) == (False, "shutting down")


def test_the_watchdog_sees_exits_always_and_silence_only_with_requests_in_flight():
    f = ready_front(watchdog_timeout=0.05)
    assert f.monitor.failed_child(in_flight=True) is None
    time.sleep(0.1)
    assert f.monitor.failed_child(in_flight=False) is None
    role, cause, _ = f.monitor.failed_child(in_flight=True)
    assert (role, cause) == ("scheduler", "stalled")
    f.scheduler_stats()
    f.detok_stats()
    assert f.monitor.failed_child(in_flight=True) is None  # heartbeats again
    f.procs["scheduler"].alive, f.procs["scheduler"].exitcode = False, 1
    assert f.monitor.failed_child(in_flight=False) == ("scheduler", "exited", "exited with code 1")


def test_engine_numbers_reach_metrics_from_the_stats_as_they_arrived():
    f = ready_front()
    f.scheduler_stats(
        generated=100,
        num_running=3,
        kv_reserved=16,
        stale_drops=[DropCount("scheduler", "AbortReq", "finished", 2)],
        undecodable=4,
    )
    time.sleep(0.2)
    f.scheduler_stats(generated=160, num_running=3, kv_reserved=16)
    f.detok_stats(handling_errors=5, stale_drops=[DropCount("detokenizer", "BatchTokenIDOutput", "abort", 1)])
    f.exposition()
    m = {"model_name": "tiny-random"}
    assert f.sample("sightline_num_requests_running", dp_rank="0", **m) == 3
    assert f.sample("sightline_kv_usage_ratio", dp_rank="0", **m) == 0.25  # 16 of 64
    assert 100 < f.sample("sightline_generation_throughput_tokens_per_second", **m) < 400  # 60 tokens in ~0.2 s
    assert f.sample("sightline_scheduler_generated_tokens_total", dp_rank="0", **m) == 160
    assert f.sample("sightline_message_handling_errors_total", component="detokenizer") == 5
    assert (
        f.sample(
            "sightline_stale_messages_dropped_total",
            component="detokenizer",
            message_type="BatchTokenIDOutput",
            reason="abort",
        )
        == 1
    )
    assert f.sample("sightline_heartbeat_age_seconds", role="scheduler") < 1
    assert f.sample("sightline_process_resident_memory_bytes", role="main") > 0
    # the latest Scheduler stats replace the earlier ones (its counters are cumulative)
    assert (
        f.sample(
            "sightline_stale_messages_dropped_total", component="scheduler", message_type="AbortReq", reason="finished"
        )
        is None
    )
    assert f.sample("sightline_undecodable_messages_total", component="scheduler") == 0


def test_before_any_stats_the_engine_numbers_read_zero():
    f = make_front()
    text = f.exposition()  # every family renders, the histograms with no series yet
    assert "sightline_engine_step_phase_seconds" in text and "sightline_engine_info" in text
    assert f.sample("sightline_num_requests_running", dp_rank="0", model_name="tiny-random") == 0
    assert f.sample("sightline_kv_slots_capacity", dp_rank="0", model_name="tiny-random") == 0
    assert (
        f.sample("sightline_engine_step_phase_seconds_count", dp_rank="0", model_name="tiny-random", phase="forward")
        is None
    )


def test_step_phases_and_engine_info_come_from_the_scheduler():
    f = ready_front()
    f.scheduler_stats(step_phases=[PhaseHistogram("forward", [0.01, 0.1], [2, 3, 1], 0.9)])
    m = {"model_name": "tiny-random", "phase": "forward"}
    assert f.sample("sightline_engine_step_phase_seconds_bucket", dp_rank="0", le="0.01", **m) == 2
    assert f.sample("sightline_engine_step_phase_seconds_bucket", dp_rank="0", le="0.1", **m) == 5  # cumulative
    assert f.sample("sightline_engine_step_phase_seconds_count", dp_rank="0", **m) == 6
    assert f.sample("sightline_engine_step_phase_seconds_sum", dp_rank="0", **m) == 0.9
    assert (
        f.sample(
            "sightline_engine_info", dp_rank="0", model_name="tiny-random", architecture="", dtype="", quantization=""
        )
        == 1
    )
    f.monitor.reset()  # an engine restart: no stats, no info, and /metrics still renders
    assert "sightline_engine_step_phase_seconds_count" not in f.exposition()


def test_a_restarted_scheduler_resets_the_token_rate():
    f = ready_front()
    f.scheduler_stats(generated=1000)
    time.sleep(0.05)
    f.scheduler_stats(generated=1100)
    assert f.monitor.throughput.rate(time.monotonic_ns()) > 0
    f.scheduler_stats(generated=5)  # a new Scheduler's counter starts over
    assert f.monitor.throughput.rate(time.monotonic_ns()) == 0.0


def test_reset_forgets_everything_the_old_children_said():
    async def body():
        f = ready_front()
        f.scheduler_stats(num_running=2)
        f.monitor.reset()
        assert not f.monitor.ready and not f.monitor.scheduler_stats and not f.monitor.last_heartbeat
        assert not f.monitor.all_ready.is_set() and f.monitor.missing() == ["scheduler", "detokenizer"]

    asyncio.run(body())
