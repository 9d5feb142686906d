"""The tracing configuration from the standard OTEL_* variables, as the OpenTelemetry SDKs read
them, with flags winning over the environment; and docs/tracing.md's table of them matches the
code. (A real server exporting with only an endpoint in its environment:
tests/e2e/test_tracing_config.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import opentelemetry
import pytest
from opentelemetry.trace import NoOpTracer

from serving.args import ServerArgs
from telemetry.tracing import Tracing, resolve_exporters, resolve_ratio, sdk_disabled, service_name, tracing_enabled
from tests.helpers import REPO

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_METRIC_EXPORT_INTERVAL",
)
ENDPOINT = "http://collector:4318"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Whatever the machine running the tests has set, each test starts from no OTEL_* variable."""
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, []),  # no endpoint: nothing to export to
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ["otlp"]),  # the SDKs' default exporter is otlp
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT + "/v1/traces"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, []),  # empty is unset
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "OTLP, otlp,"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, []),  # chosen: none
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ["otlp"]),
    ],
)
def test_exporters_from_the_environment(env, expected):
    assert resolve_exporters(None, env=env) == expected


def test_the_exporter_flag_wins_over_the_environment():
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}
    assert resolve_exporters("none", env=env) == []
    assert resolve_exporters("otlp", env={"OTEL_TRACES_EXPORTER": "none"}) == ["otlp"]


def test_an_endpoint_flag_alone_exports_otlp():
    assert resolve_exporters(None, "http://127.0.0.1:4318", env={}) == ["otlp"]
    assert resolve_exporters(None, "http://127.0.0.1:4318", env={"OTEL_TRACES_EXPORTER": "none"}) == []


def test_an_unknown_exporter_is_refused_at_startup(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        ServerArgs(model="tiny-random")


@pytest.mark.parametrize(
    "value, disabled", [("true", True), (" TRUE ", True), ("True", True), ("false", False), ("1", False), ("", False)]
)
def test_sdk_disabled_reads_as_the_sdks_do(value, disabled):
    assert sdk_disabled({"OTEL_SDK_DISABLED": value}) is disabled


@pytest.mark.parametrize(
    "flags, env, enabled",
    [
        ({}, {}, True),
        ({}, {"OTEL_SDK_DISABLED": "true"}, False),
        ({}, {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),  # env against env: disabled
        ({"otel_traces_exporter": "console"}, {"OTEL_SDK_DISABLED": "true"}, True),  # an explicit flag wins
        ({"otel_exporter_otlp_endpoint": ENDPOINT}, {"OTEL_SDK_DISABLED": "true"}, True),
        ({"otel_traces_exporter": "none"}, {"OTEL_SDK_DISABLED": "true"}, False),  # no export asked: no conflict
        ({"enable_tracing": False}, {}, False),
        ({"enable_tracing": False, "otel_traces_exporter": "console"}, {}, False),
    ],
)
def test_tracing_enabled(flags, env, enabled):
    assert tracing_enabled(ServerArgs(model="tiny-random", **flags), env) is enabled


def test_sdk_disabled_builds_no_span_in_any_process(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    records = []
    tracing = Tracing.from_args("scheduler", ServerArgs(model="tiny-random"), "i", sink=records.append)
    assert not tracing.enabled and isinstance(tracing.tracer, NoOpTracer) and tracing.provider is None
    carrier = {"traceparent": "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    assert tracing.extract(carrier) is None  # an incoming sampled context builds nothing either
    assert tracing.record("decode", tracing.extract(carrier), 1, 2) is None and records == []


def test_an_exporter_flag_traces_despite_sdk_disabled(monkeypatch):
    """The SDK's own TracerProvider also reads OTEL_SDK_DISABLED: the flag must win there too."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    records = []
    args = ServerArgs(model="tiny-random", otel_traces_exporter="console")
    tracing = Tracing.from_args("main", args, "i", sink=records.append)
    span = tracing.start("GET /x", None)
    span.end()
    tracing.shutdown()
    assert tracing.enabled and [r.name for r in records] == ["GET /x"]


@pytest.mark.parametrize(
    "flag, env, ratio",
    [
        (None, {}, 1.0),
        (0.5, {"OTEL_TRACES_SAMPLER": "always_off"}, 0.5),  # the flag wins
        (None, {"OTEL_TRACES_SAMPLER": "always_off"}, 0.0),
        (None, {"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, 0.0),
        (None, {"OTEL_TRACES_SAMPLER": "always_on"}, 1.0),
        (None, {"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, 1.0),
        (None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}, 0.25),
        (None, {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, 0.0),
        (None, {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}, 1.0),  # no argument: the SDKs' 1.0
        (None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, 1.0),
        (None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, 1.0),
        (None, {"OTEL_TRACES_SAMPLER": "jaeger_remote"}, 1.0),
        (None, {"OTEL_TRACES_SAMPLER_ARG": "0.1"}, 1.0),  # an argument without a ratio sampler
    ],
)
def test_sampling_ratio(flag, env, ratio):
    assert resolve_ratio(flag, env) == ratio


def test_service_name(monkeypatch):
    assert service_name({}) == "sightline"
    assert service_name({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=llm%20a"}) == "llm a"
    assert service_name({"OTEL_SERVICE_NAME": "llm-b", "OTEL_RESOURCE_ATTRIBUTES": "service.name=llm-a"}) == "llm-b"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-b")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod")
    attrs = Tracing("main", instance_id="i").provider.resource.attributes
    assert attrs["service.name"] == "llm-b" and attrs["deployment.environment"] == "prod"
    assert attrs["sightline.process.role"] == "main"


def _doc_table_vars() -> set[str]:
    text = (REPO / "docs" / "tracing.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in section.splitlines():
        if row.startswith("| `OTEL_"):
            first_cell = row.split("|")[1]
            names.update(re.findall(r"`(OTEL_[A-Z_]+)`", first_cell))
    return names


def test_the_docs_table_names_every_variable_the_code_reads():
    code = (REPO / "telemetry" / "tracing.py").read_text()
    read_here = set(re.findall(r'"(OTEL_[A-Z_]+)"', code))
    documented = _doc_table_vars()
    assert read_here <= documented, f"read in telemetry/tracing.py, not in docs/tracing.md: {read_here - documented}"
    # the rest of the table is read by the OpenTelemetry SDK or its exporters, not invented
    sdk = "".join(p.read_text(errors="replace") for root in opentelemetry.__path__ for p in Path(root).rglob("*.py"))
    invented = {name for name in documented - read_here if name not in sdk}
    assert not invented, f"documented but read by neither sightline nor the SDK: {invented}"


# -- OpenTelemetry GenAI metrics (telemetry/genai_metrics.py) -------------------------------------
@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, []),  # the shared endpoint (spans) alone: /metrics is enough
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ENDPOINT + "/v1/metrics"}, ["otlp"]),  # asked for metrics there
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": " "}, []),  # empty is unset
        ({"OTEL_METRICS_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_METRICS_EXPORTER": "Console, otlp,console"}, ["console", "otlp"]),
        ({"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": ENDPOINT}, []),
    ],
)
def test_metrics_exporters_from_the_environment(env, expected):
    from telemetry.genai_metrics import resolve_metrics_exporters

    assert resolve_metrics_exporters(None, env=env) == expected


def test_metrics_flags_win_over_the_environment():
    from telemetry.genai_metrics import resolve_metrics_exporters

    assert resolve_metrics_exporters("none", env={"OTEL_METRICS_EXPORTER": "otlp"}) == []
    assert resolve_metrics_exporters("console", env={"OTEL_METRICS_EXPORTER": "otlp"}) == ["console"]
    assert resolve_metrics_exporters(None, "http://127.0.0.1:4318/v1/metrics", env={}) == ["otlp"]
    assert resolve_metrics_exporters(None, "http://x/v1/metrics", env={"OTEL_METRICS_EXPORTER": "none"}) == []


def test_an_unknown_metrics_exporter_or_interval_is_refused_at_startup(monkeypatch):
    with pytest.raises(ValueError, match="prometheus"):
        ServerArgs(model="tiny-random", otel_metrics_exporter="prometheus")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        ServerArgs(model="tiny-random")
    monkeypatch.delenv("OTEL_METRICS_EXPORTER")
    with pytest.raises(ValueError, match="export-interval"):
        ServerArgs(model="tiny-random", otel_metric_export_interval=0)


@pytest.mark.parametrize(
    "flags, env, expected",
    [
        ({}, {}, []),  # off by default
        ({}, {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),  # env against env: disabled
        ({"otel_metrics_exporter": "console"}, {"OTEL_SDK_DISABLED": "true"}, ["console"]),  # a flag wins
        ({"otel_exporter_otlp_metrics_endpoint": ENDPOINT}, {"OTEL_SDK_DISABLED": "TRUE"}, ["otlp"]),
        ({"otel_exporter_otlp_endpoint": ENDPOINT}, {}, []),  # the shared endpoint flag is the spans'
    ],
)
def test_metrics_exporters_and_sdk_disabled(flags, env, expected):
    from telemetry.genai_metrics import metrics_exporters

    assert metrics_exporters(ServerArgs(model="tiny-random", **flags), env) == expected


@pytest.mark.parametrize(
    "flag, env, ms",
    [
        (None, {}, 60000),
        (250, {"OTEL_METRIC_EXPORT_INTERVAL": "1000"}, 250),
        (None, {"OTEL_METRIC_EXPORT_INTERVAL": "1000"}, 1000),
        (None, {"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, 60000),
        (None, {"OTEL_METRIC_EXPORT_INTERVAL": "-5"}, 60000),
    ],
)
def test_metric_export_interval(flag, env, ms):
    from telemetry.genai_metrics import resolve_interval

    assert resolve_interval(flag, env) == ms


def test_genai_metrics_built_only_when_exported(monkeypatch):
    from telemetry.genai_metrics import GenAIMetrics

    assert GenAIMetrics.from_args(ServerArgs(model="tiny-random"), "m", "i") is None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # the SDK's MeterProvider reads it too: the flag must win there
    genai = GenAIMetrics.from_args(
        ServerArgs(
            model="tiny-random",
            otel_metrics_exporter="none,otlp",
            otel_exporter_otlp_endpoint="http://127.0.0.1:9",
            otel_metric_export_interval=600000,
        ),
        "m",
        "inst",
    )
    try:
        assert genai is not None and not genai.provider._disabled
        assert genai.provider._sdk_config.resource.attributes["service.instance.id"] == "inst"
        assert genai.base == {
            "gen_ai.provider.name": "sightline",
            "gen_ai.request.model": "m",
            "gen_ai.response.model": "m",
        }
    finally:
        genai.provider.shutdown(timeout_millis=1)  # nothing recorded: nothing to send


def test_the_docs_table_names_every_metrics_variable_the_code_reads():
    code = (REPO / "telemetry" / "genai_metrics.py").read_text()
    read_here = set(re.findall(r'"(OTEL_[A-Z_]+)"', code))
    assert read_here and read_here <= _doc_table_vars(), read_here - _doc_table_vars()
