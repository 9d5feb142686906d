"""Every counter whose label values are known is exported at 0 before any traffic, so increase()
and alert rules see its first event: checked from `SPECS`, so a new labelled counter must either
list its series (`ZERO_SERIES`) or say why it stays lazy (`LAZY_SERIES`).

The same check against a real server's first scrape is in tests/e2e/test_process_titles.py
(it starts the servers whose processes it names)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving import __version__
from serving.args import ServerArgs
from serving.frontend.engine_state import FrontCounts
from serving.frontend.stack import front_telemetry
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.ipc import engine_roles
from telemetry.metrics import (
    COMPONENTS,
    FINISH_REASONS,
    LAZY_SERIES,
    SERVER_LABELS,
    SPECS,
    ZERO_SERIES,
    Metrics,
    zero_series,
)
from telemetry.registry_merge import Retired, merge, registry_of, snapshot

MODEL = "tiny-random"
COUNTERS = [s for s in SPECS if s.kind == "counter"]


def expected_series(dp_size: int) -> dict[str, list[dict[str, str]]]:
    """Every counter's series that must exist at 0, as the server fills in its own labels."""
    roles, ranks = tuple(engine_roles(dp_size)), tuple(range(dp_size))
    return {s.name: zero_series(s, MODEL, roles, ranks) for s in COUNTERS}


def exported(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def assert_all_zero(text: str, dp_size: int) -> None:
    got = exported(text)
    missing, nonzero = [], []
    for name, series in expected_series(dp_size).items():
        for labels in series:
            value = got.get((name, tuple(sorted(labels.items()))))
            if value is None:
                missing.append((name, labels))
            elif value != 0:
                nonzero.append((name, labels, value))
    assert not missing, f"{len(missing)} series not exported before any traffic, e.g. {missing[:5]}"
    assert not nonzero, nonzero


def test_every_labelled_counter_lists_its_series_or_says_why_not():
    for spec in COUNTERS:
        own = [label for label in spec.labels if label not in SERVER_LABELS]
        if not own:  # the server fills every label in
            continue
        assert (spec.name in ZERO_SERIES) != (spec.name in LAZY_SERIES), (
            f"{spec.name} has labels {own}: list its series in ZERO_SERIES, or say in LAZY_SERIES why not"
        )
        for labels in ZERO_SERIES.get(spec.name, ()):
            assert sorted(labels) == sorted(own), f"{spec.name}: {labels} does not give exactly {own}"
    names = {s.name for s in COUNTERS}
    assert set(ZERO_SERIES) <= names and set(LAZY_SERIES) <= {s.name for s in SPECS}
    assert all(LAZY_SERIES.values())


def test_the_known_values_are_the_codes():
    """Finish and abort reasons come from the table of endings (tests/unit/test_endings.py checks it)."""
    from protocol.reasons import FinishReason

    assert set(FINISH_REASONS) == {r.value for r in FinishReason}
    monitor = EngineMonitor(60.0, 60.0, on_stats=lambda *a: None, dp_size=1)
    assert set(monitor.view(FrontCounts()).undecodable) == set(COMPONENTS)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_one_front_end_exports_every_known_series_at_zero(dp_size):
    """As `serving.frontend.launch._serve` builds it: the TM's telemetry plus the engine's view."""
    args = ServerArgs(model=MODEL, dp_size=dp_size)
    _, _, metrics = front_telemetry(args, MODEL, "instance")
    monitor = EngineMonitor(args.stall_timeout, args.watchdog_timeout, on_stats=lambda *a: None, dp_size=dp_size)
    metrics.watch(lambda: monitor.view(FrontCounts()), lambda: 0)
    assert_all_zero(generate_latest(metrics.registry).decode(), dp_size)


def test_the_hub_merges_every_known_series_at_zero():
    """As `serving.frontend.workers.hub` answers /metrics: its own registry and the workers', merged."""
    roles = tuple(engine_roles(2))
    hub = Metrics(MODEL, version=__version__, hub=True, roles=roles)
    monitor = EngineMonitor(60.0, 60.0, on_stats=lambda *a: None, dp_size=2)
    hub.watch(lambda: monitor.view(FrontCounts()), None)
    workers = {}
    for w in range(2):
        m = Metrics(MODEL, version=__version__, roles=roles)
        m.watch(None, lambda: 0)
        workers[w] = snapshot(m.registry)
    text = generate_latest(registry_of(merge(snapshot(hub.registry), workers, Retired()))).decode()
    assert_all_zero(text, 2)


def test_a_counted_series_is_not_doubled_by_its_zero():
    """The engine's counters: a series counted by a child replaces its zero, it is not exported twice."""
    from protocol.io_struct import DropCount

    metrics = Metrics(MODEL)
    monitor = EngineMonitor(60.0, 60.0, on_stats=lambda *a: None, dp_size=1)
    drop = DropCount("tokenizer_manager", "BatchStrOutput", "client_disconnect", 3)
    metrics.watch(lambda: monitor.view(FrontCounts(stale_drops=[drop])), None)
    text = generate_latest(metrics.registry).decode()
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("sightline_stale_messages_dropped_total{")
        and 'reason="client_disconnect"' in line
        and "BatchStrOutput" in line
    ]
    assert len(lines) == 1 and lines[0].endswith(" 3.0"), lines
