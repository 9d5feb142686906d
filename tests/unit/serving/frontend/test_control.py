"""The control API's pieces without a server: who may call it, what the configuration view hides,
the runtime sampling ratio, the monitor while paused, and the dashboard annotations."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from opentelemetry.sdk.trace.sampling import Decision

from dashboards import lint
from serving.args import ServerArgs
from serving.frontend.engine_state import check_available
from serving.frontend.errors import APIError
from serving.frontend.http.middleware.auth import AuthMiddleware
from serving.frontend.http.routes import control
from serving.frontend.supervision.engine_monitor import EngineMonitor
from telemetry.tracing import _Sampler

KEY = "sk-control-test"


def call(args: ServerArgs, path: str, client: str, headers: dict[str, str] | None = None) -> int:
    """The status AuthMiddleware answers with (200: passed on to the app)."""
    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "path": path,
        "client": (client, 5000),
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    asyncio.run(AuthMiddleware(app, args)(scope, None, send))
    return sent[0]["status"]


@pytest.mark.parametrize(
    "path", ["/pause_generation", "/continue_generation", "/control/tracing", "/control/log_level", "/control/config"]
)
def test_control_endpoints_need_the_key_or_loopback(path, monkeypatch):
    monkeypatch.delenv("SIGHTLINE_API_KEY", raising=False)
    keyed = ServerArgs(api_key=KEY)
    assert call(keyed, path, "127.0.0.1") == 401  # loopback is no excuse once a key is set
    assert call(keyed, path, "10.0.0.7", {"authorization": f"Bearer {KEY}"}) == 200
    open_args = ServerArgs()
    assert call(open_args, path, "127.0.0.1") == 200
    assert call(open_args, path, "::1") == 200
    assert call(open_args, path, "10.0.0.7") == 403
    assert call(ServerArgs(control_from_anywhere=True), path, "10.0.0.7") == 200
    assert call(open_args, "/v1/models", "10.0.0.7") == 200  # other routes: unchanged


def test_config_view_hides_secrets(monkeypatch):
    monkeypatch.setenv("SIGHTLINE_API_KEY", KEY)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer abc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc")
    args = ServerArgs(otel_exporter_otlp_endpoint="https://user:pw@collector:4318")
    state = types.SimpleNamespace(
        args=args,
        engine=types.SimpleNamespace(paused="drain"),
        hub=None,
        tel=types.SimpleNamespace(tracing=types.SimpleNamespace(sampling_ratio=0.5)),
    )
    cfg = control.effective_config(state)
    text = json.dumps(cfg)
    assert KEY not in text and "abc" not in text and "pw@" not in text
    assert cfg["args"]["api_key"] == "***" and cfg["environment"]["SIGHTLINE_API_KEY"] == "***"
    assert cfg["environment"]["OTEL_EXPORTER_OTLP_HEADERS"] == "***"
    assert cfg["environment"]["OTEL_SERVICE_NAME"] == "svc"
    assert cfg["args"]["otel_exporter_otlp_endpoint"] == "https://***@collector:4318"
    assert cfg["args"]["max_total_tokens"] == args.max_total_tokens  # "tokens" is not a secret
    assert cfg["runtime"]["paused"] == "drain" and cfg["runtime"]["sampling_ratio"] == 0.5


def test_sampling_ratio_changes_at_runtime():
    sampler = _Sampler(1.0)
    trace_id = (1 << 127) + 12345  # sampled at 1.0, not at 0.0
    assert sampler.should_sample(None, trace_id, "x").decision == Decision.RECORD_AND_SAMPLE
    sampler.set_ratio(0.0)
    assert sampler.should_sample(None, trace_id, "x").decision == Decision.DROP
    assert sampler.ratio.rate == 0.0


def test_monitor_while_paused():
    mon = EngineMonitor(stall_timeout=1.0, watchdog_timeout=1.0)
    mon.all_ready.set()
    mon.pause("drain")
    assert mon.health(None) == (False, "paused")
    with pytest.raises(APIError) as exc:
        check_available(mon, None)
    assert exc.value.status == 503 and exc.value.code == "paused" and "Retry-After" in exc.value.headers
    old = 1  # an in-flight request that arrived long ago, no token since
    assert mon.seconds_without_token(old) > 1.0  # drain: the engine runs, stalls still count
    mon.pause("in_place")
    assert mon.seconds_without_token(old) == 0.0  # no token is due while paused in place
    mon.unpause()
    mon.stepping_again()
    assert mon.seconds_without_token(old) < 1.0  # the stall clock restarts at the resume


def test_overview_annotates_control_actions_and_pauses():
    from tests.helpers import boards

    board = boards()["sightline-overview"]
    exprs = {a["name"]: a["expr"] for a in board["annotations"]["list"]}
    assert "sightline_control_actions_total" in exprs["Control actions"]
    assert "sightline_paused" in exprs["Generation paused"]
    bad = {
        **board,
        "annotations": {"list": [{**board["annotations"]["list"][0], "expr": "sightline_control_actions_total > 0"}]},
    }
    assert any("outside rate" in p for p in lint.dashboard_problems(bad))
