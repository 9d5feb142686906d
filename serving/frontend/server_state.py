"""What the HTTP handlers share: the TokenizerManager, telemetry, the child processes, health."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import psutil

from serving.args import ServerArgs
from serving.frontend.errors import APIError
from serving.ipc import Endpoints
from serving.frontend.tokenizer_manager import TokenizerManager
from telemetry.clock import now_ns
from telemetry.loop_lag import LoopLagMonitor
from telemetry.metrics import EngineSnapshot, Metrics
from telemetry.request_telemetry import RequestTelemetry
from telemetry.timeline import Timeline


@dataclass
class ServerState:
    args: ServerArgs
    tm: TokenizerManager
    tel: RequestTelemetry
    timeline: Timeline
    metrics: Metrics | None
    model_name: str
    endpoints: Endpoints
    procs: dict[str, BaseProcess] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False
    engine_failure: str | None = None  # set while the supervisor recovers from it
    restart_status: str | None = None  # which restart attempt is under way (or waiting out its backoff)
    engine_down: str | None = None  # set for good once the restart budget is spent
    loop_lag: LoopLagMonitor = field(default_factory=lambda: LoopLagMonitor(None))
    _ps: dict[int, psutil.Process] = field(default_factory=dict)

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): ready, both children alive, not shutting down."""
        if self.shutting_down:
            return False, "shutting down"
        if self.engine_down:
            return False, self.engine_down
        if self.engine_failure:
            return False, f"engine failure ({self.engine_failure}); {self.restart_status or 'restarting'}"
        for role, proc in self.procs.items():
            if not proc.is_alive():
                return False, f"{role} process exited (code {proc.exitcode})"
        if not self.tm.all_ready.is_set():
            return False, "starting: waiting for " + ", ".join(sorted({"scheduler", "detokenizer"} - self.tm.ready.keys()))
        stuck = self.seconds_without_token()
        if stuck > self.args.stall_timeout:
            return False, f"engine stuck: requests in flight and no token for {stuck:.0f} s"
        return True, "ok"

    def seconds_without_token(self) -> float:
        """With requests in flight: seconds since the later of the last token and the oldest arrival."""
        oldest = self.tm.oldest_arrival()
        if oldest is None:
            return 0.0
        s = self.tm.scheduler_stats
        last = max(oldest, (s.last_token_at or 0) if s else 0)
        return (now_ns() - last) / 1e9

    def check_available(self) -> None:
        ok, reason = self.health()
        if not ok:
            raise APIError(503, f"server unavailable: {reason}", type="server_unavailable")

    def describe(self) -> dict:
        return {"pids": {role: p.pid for role, p in self.procs.items()}, "runtime_dir": self.endpoints.runtime_dir,
                "model": self.model_name, "ready_rejected": dict(self.tm.ready_rejected),
                "event_loop_lag_seconds": {"last": self.loop_lag.last, "worst": self.loop_lag.worst}}

    def _proc(self, pid: int | None) -> psutil.Process | None:
        if pid is None:
            return None
        p = self._ps.get(pid)
        if p is None:
            try:
                p = self._ps[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return p

    def _resources(self) -> tuple[dict[str, float], dict[str, float]]:
        rss, cpu = {}, {}
        pids = {"main": os.getpid(), **{role: p.pid for role, p in self.procs.items() if p.is_alive()}}
        for role, pid in pids.items():
            p = self._proc(pid)
            try:
                if p is not None:
                    rss[role] = float(p.memory_info().rss)
                    t = p.cpu_times()
                    cpu[role] = t.user + t.system
            except psutil.Error:
                self._ps.pop(pid, None)
        return rss, cpu

    def engine_snapshot(self) -> EngineSnapshot:
        """The children's latest numbers, for the Prometheus scrape (telemetry.metrics.EngineCollector)."""
        tm, now = self.tm, now_ns()
        s, d = tm.scheduler_stats, tm.detok_stats
        drops = [(x.component, x.message_type, x.reason, x.count) for x in tm.stale_drops()]
        rss, cpu = self._resources()
        snap = EngineSnapshot(
            stale_drops=drops, rss=rss, cpu=cpu,
            undecodable={"tokenizer_manager": tm.codec.undecodable, "scheduler": s.undecodable if s else 0,
                         "detokenizer": d.undecodable if d else 0},
            handling_errors={"tokenizer_manager": tm.handling_errors.count,
                             "scheduler": s.handling_errors if s else 0, "detokenizer": d.handling_errors if d else 0},
            heartbeat_age={role: (now - t) / 1e9 for role, t in tm.last_heartbeat.items()},
        )
        snap.seconds_since_last_token = self.seconds_without_token()
        if s is not None:
            snap.running, snap.waiting, snap.kv_used, snap.kv_reserved = s.num_running, s.num_waiting, s.kv_used, \
                s.kv_reserved
            snap.kv_total, snap.batch_size, snap.step_seconds = s.kv_total, s.batch_size, s.step_seconds
            snap.steps_total, snap.generated_tokens_total = s.steps_total, s.generation_tokens_total
            snap.prefill_tokens_total = s.prefill_tokens_total
            snap.throughput = tm.throughput.rate(now)
        return snap
