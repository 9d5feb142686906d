"""A fresh server, once with one process per role and once with two Scheduler ranks and two
tokenizer workers: every process is titled `sightline::<role>` (what ps, top and
/proc/<pid>/cmdline show), and its first /metrics scrape already has every counter whose label
values are known, at 0 (telemetry.metrics.ZERO_SERIES; the unit-level check is
tests/unit/test_counters_from_zero.py). One server start serves both checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.ipc import engine_roles
from telemetry.metrics import SPECS, zero_series
from tests.server_util import ServerProc, samples, scrape

VARIANTS = {
    "single": ((), "main", {"scheduler", "detokenizer"}, 1),
    "dp2-workers2": (
        ("--dp-size", "2", "--tokenizer-worker-num", "2"),
        "hub",
        {"scheduler_dp0", "scheduler_dp1", "detokenizer", "worker-1", "worker-2"},
        2,
    ),
}
TOUCHED_AT_STARTUP = {"sightline_health_checks_total"}  # /health is polled until the server is up


@pytest.fixture(scope="module", params=list(VARIANTS))
def fresh(request, tmp_path_factory):
    flags, main_role, roles, dp_size = VARIANTS[request.param]
    srv = ServerProc(*flags, tmpdir=tmp_path_factory.mktemp(request.param))
    try:
        first_scrape = scrape(srv)
        yield srv, first_scrape, main_role, roles, dp_size
    finally:
        srv.stop()


def title(pid: int) -> str:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.split(b"\0")[0].decode().strip()


def test_every_process_is_titled_by_its_role(fresh):
    srv, _, main_role, roles, _ = fresh
    assert set(srv.pids) == roles
    titles = {role: title(pid) for role, pid in {main_role: srv.proc.pid, **srv.pids}.items()}
    assert titles == {role: f"sightline::{role}" for role in titles}
    # the kernel's short name (top, pgrep) says sightline too, cut at 15 bytes
    for role, pid in {main_role: srv.proc.pid, **srv.pids}.items():
        assert Path(f"/proc/{pid}/comm").read_text().strip() == f"sightline::{role}"[:15]


def test_the_first_scrape_has_every_known_counter_at_zero(fresh):
    _, text, _, _, dp_size = fresh
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples(text)}
    model = next(s.labels["model_name"] for s in samples(text) if s.name == "sightline_build_info")
    missing, nonzero = [], []
    for spec in SPECS:
        for labels in zero_series(spec, model, tuple(engine_roles(dp_size)), tuple(range(dp_size))):
            value = got.get((spec.name, tuple(sorted(labels.items()))))
            if value is None:
                missing.append((spec.name, labels))
            elif value != 0 and spec.name not in TOUCHED_AT_STARTUP:
                nonzero.append((spec.name, labels, value))
    assert not missing, f"{len(missing)} series missing from the first scrape, e.g. {missing[:5]}"
    assert not nonzero, nonzero
