"""The metric catalogue is the one place metrics are defined: every main-process metric
is a typed `Metrics` attribute, every engine metric reads a real `EngineView` path."""

from __future__ import annotations

import typing

from protocol.io_struct import SchedulerStats
from telemetry.metrics import SPECS, Metrics
from telemetry.stats import EngineView


def test_every_metric_is_either_a_typed_handle_or_read_from_the_engine_view():
    for spec in SPECS:
        assert bool(spec.attr) != bool(spec.read), spec.name
        assert (spec.source == "main") == bool(spec.attr), spec.name
    hints = typing.get_type_hints(Metrics)
    assert {s.attr for s in SPECS if s.attr} == set(hints)
    m = Metrics("x")
    for spec in SPECS:
        if spec.attr:
            handle = getattr(m, spec.attr)
            assert isinstance(handle, hints[spec.attr]) and handle._labelnames == spec.labels, spec.name


def test_every_engine_read_path_exists():
    view_fields = set(typing.get_type_hints(EngineView)) | {
        name for name, v in vars(EngineView).items() if isinstance(v, property)
    }  # the whole server's numbers
    sched = set(SchedulerStats.__struct_fields__) | {"kv_usage_ratio"}
    for spec in SPECS:
        if not spec.read:
            continue
        root, _, leaf = spec.read.partition(".")
        if root == "scheduler":  # read from each rank's stats, one series per dp_rank
            assert leaf in sched and spec.labels[-1:] == ("dp_rank",) or "dp_rank" in spec.labels, spec.name
        else:
            assert root in view_fields, spec.name
