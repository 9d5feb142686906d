"""Shared fixtures: real models (tiny-random for speed, the bundled SmolLM2-135M where it matters),
real servers, a real OTLP receiver.  Helpers the tests import live in `tests/helpers.py`."""

from __future__ import annotations

import pytest

from serving.engine.loader import LoadedModel, load_model
from tests.otlp_receiver import OTLPReceiver

# The second lane of `make test` (scripts/run_tests.py), run beside the unit tests and the other e2e modules:
# the modules that mostly wait on fixed durations, Prometheus, HAProxy, Locust or larger models, and enough
# of the rest to end both lanes together (per-module times of a 2-core run are in docs/testing.md).
STACK_MODULES = frozenset({
    "test_chaos_soak", "test_soak_short", "test_replicas", "test_alerting", "test_loadtest", "test_locust_plain",
    "test_model_families_server", "test_server_smollm", "test_admission_server",
})
BALANCE_MODULES = frozenset({
    "test_fuzz", "test_faults", "test_transport_limits", "test_front_hardening", "test_restart_budget",
    "test_workers_dp", "test_disconnect_storm", "test_isolation_server", "test_tenants", "test_server_lifecycle",
    "test_shutdown_workers", "test_why_downstream",
})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in STACK_MODULES | BALANCE_MODULES:
            item.add_marker(pytest.mark.lane2)


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

    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("tiny-server"))
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
