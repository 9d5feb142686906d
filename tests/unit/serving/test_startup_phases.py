"""The phase clock: each phase ends where the next begins, `imports` starts at the process's creation, and the
progress callback and the spans see every phase."""

from __future__ import annotations

from serving import startup_phases
from serving.startup_phases import PhaseClock, process_started_ns
from telemetry.clock import now_ns
from telemetry.tracing import Tracing


def test_phases_are_contiguous_and_finish_is_idempotent():
    seen: list[str] = []
    c = PhaseClock("scheduler", 0, on_phase=seen.append)
    c.begin("imports", at=1_000_000_000)
    c.begin("weight_load", at=3_500_000_000)
    c.begin("kv_pool", at=4_000_000_000)
    c._end(4_250_000_000)
    assert [(p.role, p.phase, p.seconds) for p in c.phases()] == [
        ("scheduler", "imports", 2.5),
        ("scheduler", "weight_load", 0.5),
        ("scheduler", "kv_pool", 0.25),
    ]
    assert seen == ["imports", "weight_load", "kv_pool"]
    assert c.finish() == c.phases() and not c.current  # nothing under way: a second finish adds nothing


def test_process_clock_starts_at_the_process_creation():
    before = now_ns()
    c = startup_phases.start("main")
    try:
        assert c.current == "imports" and c.started_ns == c._since <= before
        assert c.started_ns > before - 3600 * 10**9  # this test process is younger than an hour
        startup_phases.begin("args")
        phases = c.finish()
        assert [p.phase for p in phases] == ["imports", "args"] and all(p.seconds >= 0 for p in phases)
        startup_phases.begin("spawn")  # once the start is over, a later phase (a restart) is not the start's
        assert [p.phase for p in c.phases()] == ["imports", "args"]
    finally:
        startup_phases._clock = None
    assert process_started_ns() <= now_ns()


def test_a_phase_counts_the_phases_begun_inside_it():
    c = startup_phases.start("scheduler")
    try:
        startup_phases.begin("kv_pool")
        with startup_phases.counted_as("draft_model"):
            startup_phases.begin("weight_load")  # a second model's load: part of draft_model
            startup_phases.begin("kv_pool")
        startup_phases.begin("peak_probe")
        assert [p.phase for p in c.finish()] == ["imports", "kv_pool", "draft_model", "peak_probe"]
    finally:
        startup_phases._clock = None


def test_report_phases_sends_the_phase_under_way_then_each_new_one():
    sent = []
    try:
        c = startup_phases.report_phases("detokenizer", sent.append)
        c.begin("tokenizer_load")
        assert [(m.role, m.phase) for m in sent] == [("detokenizer", "imports"), ("detokenizer", "tokenizer_load")]
    finally:
        startup_phases._clock = None


def test_spans_one_root_and_a_child_per_phase():
    records = []
    tracing = Tracing("scheduler", sink=records.append)
    c = PhaseClock("scheduler", 0)
    t = now_ns()
    c.begin("imports", at=t - 2_000_000)
    c.begin("weight_load", at=t - 1_000_000)
    c.finish()
    c.record_spans(tracing)
    by_name = {r.name: r for r in records}
    assert set(by_name) == {"startup", "startup.imports", "startup.weight_load"}
    root = by_name["startup"]
    for name in ("startup.imports", "startup.weight_load"):
        assert by_name[name].parent_span_id == root.span_id and by_name[name].trace_id == root.trace_id
    assert by_name["startup.weight_load"].attributes["sightline.startup.phase"] == "weight_load"
    assert root.end_ns - root.start_ns >= 2_000_000 - 1000
