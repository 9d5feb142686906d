"""Shared fixtures: real models (tiny-random for speed, the bundled SmolLM2-135M where it matters),
real servers, a real OTLP receiver.  Helpers the tests import live in `tests/helpers.py`."""

from __future__ import annotations

import pytest

from serving.engine.loader import LoadedModel, load_model
from tests.otlp_receiver import OTLPReceiver

# The stack lane of `make test` (scripts/run_tests.py): modules that mostly wait on fixed durations,
# Prometheus, HAProxy, Locust or larger models, run beside the fast lane.
STACK_MODULES = frozenset({
    "test_chaos_soak", "test_soak_short", "test_replicas", "test_alerting", "test_loadtest", "test_locust_plain",
    "test_model_families_server", "test_server_smollm", "test_admission_server",
})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in STACK_MODULES:
            item.add_marker(pytest.mark.stack)


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
