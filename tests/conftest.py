"""Shared fixtures: real models (tiny-random for speed, the bundled SmolLM2-135M where it matters),
real servers, a real OTLP receiver.  Helpers the tests import live in `tests/helpers.py`."""

from __future__ import annotations

import json
import os
import resource

import pytest

from serving.engine.loader import LoadedModel, load_model
from tests.otlp_receiver import OTLPReceiver

# The OpenMP wait policy of the server's Scheduler (`--thread-wait-policy passive`, the default) for the engines
# the tests run in this process; read when torch loads OpenMP, and nothing above imports torch.  Spinning (the
# runtime's default), torch's two threads wait for each other at every op when the other test lane has a core:
# ~3x the time of SmolLM2's forward passes there, and twice the CPU seconds alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The second lane of `make test` (scripts/run_tests.py), run beside the unit lane and the other e2e modules:
# the modules that mostly wait on fixed durations, Prometheus, HAProxy, Locust or larger models, and enough
# of the rest to end both lanes together (per-module times of a 2-core run are in docs/testing.md).
STACK_MODULES = frozenset(
    {
        "test_chaos_soak",
        "test_soak_short",
        "test_replicas",
        "test_alerting",
        "test_loadtest",
        "test_locust_plain",
        "test_model_families_server",
        "test_server_smollm",
        "test_admission_server",
        "test_lm_eval",
    }
)
BALANCE_MODULES = frozenset(
    {
        "test_faults",
        "test_transport_limits",
        "test_restart_budget",
        "test_workers_dp",
        "test_shutdown_workers",
        "test_process_titles",
        "test_spec_draft_server",
    }
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in STACK_MODULES | BALANCE_MODULES:
            item.add_marker(pytest.mark.lane2)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.fixture(scope="module", autouse=True)
def _module_cpu(request):
    """CPU seconds of each module, its servers included (counted when they exit), for the summary of
    scripts/run_tests.py: on 2 cores the suite's length is its CPU time, not its sleeps."""
    path = os.environ.get("SIGHTLINE_TEST_CPU_LOG")  # set by scripts/run_tests.py
    before = _cpu_seconds()
    yield
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"module": request.module.__name__, "cpu": round(_cpu_seconds() - before, 2)}) + "\n")


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(params=["tiny", "smollm"])
def any_model(request) -> LoadedModel:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """One real server (three processes, ZMQ, HTTP) on tiny-random, shared by the API tests."""
    from tests.server_util import ServerProc

    srv = ServerProc("--peak-probe", tmpdir=tmp_path_factory.mktemp("tiny-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory):
    """One real tiny-random server with an API key (`tests.server_util.TEST_KEY`), shared by the
    modules that test what the key protects (auth, /debug/profile, /debug/ui)."""
    from tests.server_util import TEST_KEY, ServerProc

    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("keyed-server"), env={"SIGHTLINE_API_KEY": TEST_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny-random server of the module's own, for tests whose counts must not see other modules' traffic."""
    from tests.server_util import ServerProc

    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("server"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def otlp():
    """A real OTLP receiver (HTTP), one per test module."""
    r = OTLPReceiver()
    yield r
    r.close()
