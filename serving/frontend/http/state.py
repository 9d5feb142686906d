"""What the HTTP handlers share: the TokenizerManager, the engine as it sees it, telemetry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serving.args import ServerArgs
from serving.frontend.engine_state import EngineState, Hub
from serving.frontend.http.routes.responses_store import ResponseStore
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.frontend.tenants.store import KeyStore
from serving.frontend.tokenizer_manager.manager import TokenizerManager
from serving.ipc import Endpoints
from telemetry.clock import now_ns
from telemetry.loop_lag import LoopLagMonitor
from telemetry.metrics import Metrics
from telemetry.request_telemetry import RequestTelemetry
from telemetry.timeline import Timeline


@dataclass
class ServerState:
    args: ServerArgs
    tm: TokenizerManager
    engine: EngineState  # the EngineMonitor, or in a tokenizer worker its HubLink
    tel: RequestTelemetry
    timeline: Timeline
    metrics: Metrics | None
    model_name: str
    endpoints: Endpoints
    started_at: float = field(default_factory=time.time)
    loop_lag: LoopLagMonitor = field(default_factory=lambda: LoopLagMonitor(None))
    monitor: EngineMonitor | None = None  # where this process supervises the engine (one worker): control, /debug/state
    hub: Hub | None = None  # one of several tokenizer workers: /metrics and /debug/* ask the hub
    keys: KeyStore | None = None  # the API keys in force (the auth middleware's), reloaded in place
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))  # /v1/responses stored

    def health(self) -> tuple[bool, str]:
        return self.engine.health(self.tm.oldest_arrival())

    def in_flight_requests(self, limit: int = 100) -> list[dict]:
        """The requests this front end holds now (`rid_to_state`), oldest first: `/debug/requests?in_flight=1`."""
        now = now_ns()
        states = sorted(self.tm.rid_to_state.values(), key=lambda s: s.arrival)[:limit]
        worker = {"worker": self.hub.worker} if self.hub is not None else {}
        return [
            {
                "rid": s.rid,
                "route": s.route,
                "state": "running" if s.started else "queued",
                "age_ms": round((now - s.arrival) / 1e6, 3),
                "stream": s.stream,
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "cached_tokens": s.cached_tokens,
                "dp_rank": s.dp_rank,
                "tenant": s.tenant,
                "trace_id": s.trace.trace_id,
                **worker,
            }
            for s in states
        ]

    def debug_state(self) -> dict:
        """/debug/state of a single-process server (with workers the hub answers it)."""
        return {
            "in_flight": len(self.tm.rid_to_state),
            **self.monitor.debug_state(self.tm.counts()),
            "runtime_dir": self.endpoints.runtime_dir,
            "model": self.model_name,
            "event_loop_lag_seconds": {"last": self.loop_lag.last, "worst": self.loop_lag.worst},
            "tenants": self.tm.tenants.limiter.snapshot() if hasattr(self.tm.tenants, "limiter") else {},
        }
