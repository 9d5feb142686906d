"""The one owner of what the supervising process knows about the engine: Ready,
heartbeats, the children's stats, their processes, and from all that the server's health.

The TokenizerManager (or the hub) hands it every message that is not a request's output;
the supervisor tells it which children it spawned (only those may report Ready) and what
it is doing about a failure (`failed`, `restarting`, `recovered`, `give_up`); the control
API tells it about pauses (`pause`, `unpause`, `stepping_again`); the drain tells it the
server is stopping (`begin_shutdown`).  Those methods are the only writers of its state:
every other module reads it.  /health, 503s, the watchdog, /debug/state and the
`/metrics` engine numbers all read it.  It implements `engine_state.EngineState`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import msgspec
import psutil

from protocol.io_struct import (
    DetokenizerStats,
    DropCount,
    GapCount,
    Ready,
    SchedulerStats,
    StartupPhase,
    StartupProgress,
)
from serving import startup_phases
from serving.frontend.engine_state import PAUSED, FrontCounts
from serving.ipc import engine_roles, scheduler_role
from serving.ratelog import RateLimitedLog
from telemetry.clock import now_ns
from telemetry.downstream_gaps import merge as merge_gaps
from telemetry.stats import EngineView

log = logging.getLogger("sightline.engine_monitor")


class RateWindow:
    """Rate of a cumulative counter over the last few seconds (tokens/s from stats)."""

    def __init__(self, seconds: float) -> None:
        self.window_ns = int(seconds * 1e9)
        self.points: deque[tuple[int, int]] = deque()

    def add(self, t: int, total: int) -> None:
        if self.points and total < self.points[-1][1]:
            self.points.clear()  # the counter restarted (a new Scheduler)
        self.points.append((t, total))
        while len(self.points) > 2 and self.points[1][0] < t - self.window_ns:
            self.points.popleft()

    def rate(self, now: int) -> float:
        if len(self.points) < 2 or now - self.points[-1][0] > self.window_ns:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / ((t1 - t0) / 1e9) if t1 > t0 else 0.0


def merge_drops(drops: list[DropCount]) -> list[DropCount]:
    """One counter per (component, message_type, reason): several ranks' counts summed."""
    total: dict[tuple[str, str, str], int] = {}
    for d in drops:
        key = (d.component, d.message_type, d.reason)
        total[key] = total.get(key, 0) + d.count
    return [DropCount(*k, n) for k, n in sorted(total.items())]


def sum_stats(stats: list[SchedulerStats]) -> dict:
    """Every rank's numeric stats summed (for /debug/state's one-line view of the engine)."""
    out: dict[str, int | float] = {}
    for st in stats:
        for k, v in msgspec.structs.asdict(st).items():
            if (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and k not in ("sent_at", "dp_rank", "last_token_at")
            ):
                out[k] = out.get(k, 0) + v
    return out


class EngineMonitor:
    def __init__(
        self,
        stall_timeout: float,
        watchdog_timeout: float,
        on_stats: Callable[[Any, int | None], None] = lambda msg, recv: None,
        dp_size: int = 1,
        queue_stuck_timeout: float = 30.0,
    ) -> None:
        self.dp_size = dp_size
        self.roles = engine_roles(dp_size)
        self.stall_timeout = stall_timeout
        self.queue_stuck_timeout = queue_stuck_timeout
        self.watchdog_timeout = watchdog_timeout
        self.on_stats = on_stats  # telemetry: the stats' hop latency and finished spans
        self._procs: dict[str, BaseProcess] = {}
        self._workers: dict[str, BaseProcess] = {}  # tokenizer workers (the hub's), for their CPU and memory
        self._awaiting_ready: dict[str, int] = {}  # role -> pid of the child just spawned
        self._ready: dict[str, Ready] = {}
        self._all_ready = asyncio.Event()
        self._ready_rejected: dict[str, int] = {}  # Ready messages refused, by reason
        self.ready_log = RateLimitedLog(log, interval=10.0, level=logging.WARNING)
        self._scheduler_stats: dict[int, SchedulerStats] = {}  # by dp rank, the latest of each
        self._detok_stats: DetokenizerStats | None = None
        self._last_heartbeat: dict[str, int] = {}
        self._throughput = RateWindow(seconds=5.0)
        self._shutting_down = False
        self._failure: str | None = None  # set while the supervisor recovers from it
        self._restart_status: str | None = None  # which restart attempt is under way
        self._down: str | None = None  # set for good once the restart budget is spent
        self._down_at: int | None = None  # monotonic ns when it was
        self._paused: str | None = None  # the pause mode an operator set (POST /pause_generation), None when serving
        self._pause_epoch = 0  # of the latest in_place pause sent to the Scheduler ranks
        self._resumed_at = 0  # monotonic ns of the latest in_place pause's end: the stall clock restarts there
        self._ps: dict[int, psutil.Process] = {}
        self._dispatch: dict[type, Callable[[Any], bool]] = {
            SchedulerStats: self._on_scheduler_stats,
            DetokenizerStats: self._on_detok_stats,
            Ready: self._on_ready,
            StartupProgress: self._on_progress,
        }
        self._starting: dict[str, str] = {}  # role -> the phase of its start under way (until its Ready)

    # -- messages -------------------------------------------------------------------
    def handle(self, msg: Any) -> bool | None:
        """Apply a child's message: True if applied, False if refused (a Ready from the wrong
        process), None if it is not a message the monitor handles."""
        handler = self._dispatch.get(type(msg))
        return None if handler is None else handler(msg)

    def _on_scheduler_stats(self, msg: SchedulerStats) -> bool:
        if not 0 <= msg.dp_rank < self.dp_size:
            return False
        now = now_ns()
        self._scheduler_stats[msg.dp_rank] = msg
        self._last_heartbeat[scheduler_role(msg.dp_rank, self.dp_size)] = now
        self._throughput.add(now, sum(s.generation_tokens_total for s in self._scheduler_stats.values()))
        self.on_stats(msg, now)
        return True

    def _on_detok_stats(self, msg: DetokenizerStats) -> bool:
        self._detok_stats = msg
        self._last_heartbeat["detokenizer"] = now_ns()
        self.on_stats(msg, None)
        return True

    def _on_progress(self, msg: StartupProgress) -> bool:
        """A child just spawned began a phase of its start (from anyone else: refused, as a stray Ready is)."""
        if self._awaiting_ready.get(msg.role) != msg.pid:
            return False
        self._starting[msg.role] = msg.phase
        return True

    def _on_ready(self, msg: Ready) -> bool:
        """Apply a Ready only from the child just spawned for its role, once; count and drop any other.

        A Ready sets the context length and vocabulary every request is validated against:
        one from anyone else (a stale child, a stray writer on the socket) must never apply.
        """
        expected = self._awaiting_ready.get(msg.role)
        if expected is None or msg.pid != expected:
            reason = "not_starting" if expected is None else "wrong_pid"
            self._ready_rejected[reason] = self._ready_rejected.get(reason, 0) + 1
            why = (
                "no start of that role is awaiting one"
                if expected is None
                else f"the {msg.role} just spawned has pid {expected}"
            )
            self.ready_log.report(f"ignored a Ready(role={msg.role[:32]!r}, pid={msg.pid}): {why}")
            return False
        del self._awaiting_ready[msg.role]  # once per start
        self._starting.pop(msg.role, None)
        log.info("%s ready (pid %d)", msg.role, msg.pid)
        self._ready[msg.role] = msg
        self._last_heartbeat[msg.role] = now_ns()
        if set(self.roles) <= self._ready.keys():
            self._all_ready.set()
        return True

    # -- what the supervisor tells it --------------------------------------------------
    def expect(self, procs: dict[str, BaseProcess]) -> None:
        """These children were just spawned: only they may report Ready."""
        self._procs = procs
        self._awaiting_ready = {role: p.pid for role, p in procs.items()}
        self._starting = {}

    def watch_workers(self, procs: dict[str, BaseProcess]) -> None:
        """The hub's tokenizer workers now (for their CPU, memory and pids)."""
        self._workers = procs

    def failed(self, what: str) -> None:
        """An engine process failed (`what`: its role and how); the supervisor recovers from it."""
        self._failure = what

    def restarting(self, status: str) -> None:
        """Which restart attempt is under way (shown in /health and every 503)."""
        self._restart_status = status

    def recovered(self) -> None:
        """The engine is back: the failure and the restart are over."""
        self._failure = self._restart_status = None

    def give_up(self, message: str) -> None:
        """The restart budget is spent: the engine stays down for good, saying `message`."""
        self._down, self._down_at = message, now_ns()
        self._failure = self._restart_status = None
        self._procs = {}

    def begin_shutdown(self) -> None:
        self._shutting_down = True

    # -- what the control API tells it -----------------------------------------------------
    def pause(self, mode: str) -> None:
        """An operator paused generation in `mode`: from now on new requests get 503 paused."""
        self._paused = mode

    def unpause(self) -> None:
        self._paused = None

    def next_pause_epoch(self) -> int:
        """The epoch of a new in_place pause, to send to every Scheduler rank."""
        self._pause_epoch += 1
        return self._pause_epoch

    def stepping_again(self) -> None:
        """An in_place pause ends: the stall clock restarts now, not at the last token."""
        self._resumed_at = now_ns()

    # -- its state, read by everyone else ------------------------------------------------------
    @property
    def procs(self) -> dict[str, BaseProcess]:
        return self._procs

    @property
    def workers(self) -> dict[str, BaseProcess]:
        return self._workers

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def restart_status(self) -> str | None:
        return self._restart_status

    @property
    def down(self) -> str | None:
        return self._down

    @property
    def down_at(self) -> int | None:
        return self._down_at

    @property
    def paused(self) -> str | None:
        return self._paused

    @property
    def pause_epoch(self) -> int:
        return self._pause_epoch

    @property
    def awaiting_ready(self) -> dict[str, int]:
        return self._awaiting_ready

    @property
    def ready(self) -> dict[str, Ready]:
        return self._ready

    @property
    def all_ready(self) -> asyncio.Event:
        return self._all_ready

    @property
    def ready_rejected(self) -> dict[str, int]:
        return self._ready_rejected

    @property
    def scheduler_stats(self) -> dict[int, SchedulerStats]:
        return self._scheduler_stats

    @property
    def detok_stats(self) -> DetokenizerStats | None:
        return self._detok_stats

    @property
    def last_heartbeat(self) -> dict[str, int]:
        return self._last_heartbeat

    @property
    def throughput(self) -> RateWindow:
        return self._throughput

    def reset(self) -> None:
        """The children are being replaced: forget everything they said."""
        self._ready.clear()
        self._all_ready.clear()
        self._awaiting_ready.clear()
        self._scheduler_stats, self._detok_stats = {}, None
        self._last_heartbeat.clear()

    def ranks_paused(self, epoch: int) -> bool:
        """Every Scheduler rank's latest stats say pause `epoch` is in effect (no step runs)."""
        return all(
            self._scheduler_stats.get(r) is not None and self._scheduler_stats[r].paused == epoch
            for r in range(self.dp_size)
        )

    def missing(self) -> list[str]:
        return [r for r in self.roles if r not in self._ready]

    def failed_child(self, in_flight: bool) -> tuple[str, str, str] | None:
        """(role, cause, detail) of a child that exited, or (with requests in flight) stopped heartbeating."""
        for role, p in self.procs.items():
            if not p.is_alive():
                return role, "exited", f"exited with code {p.exitcode}"
        if self._all_ready.is_set() and in_flight:
            now = now_ns()
            for role in self.roles:
                age = (now - self._last_heartbeat.get(role, now)) / 1e9
                if age > self.watchdog_timeout:
                    return role, "stalled", f"sent no heartbeat for {age:.1f} s with requests in flight"
        return None

    # -- facts the front end validates against ---------------------------------------------
    @property
    def engine_ready(self) -> Ready | None:
        """Rank 0's Ready once every child is ready: what the engine computes with."""
        return self._ready.get(self.roles[0]) if self._all_ready.is_set() else None

    @property
    def last_token_at(self) -> int | None:
        return max((s.last_token_at or 0 for s in self._scheduler_stats.values()), default=0) or None

    # -- health -------------------------------------------------------------------------
    def health(self, oldest_arrival: int | None) -> tuple[bool, str]:
        """(healthy, reason): ready, both children alive, not stuck, not shutting down."""
        if self.shutting_down:
            return False, "shutting down"
        if self.down:
            return False, self.down
        if self.failure:
            starting = f"; starting: {self._waiting_for()}" if self._starting and self._awaiting_ready else ""
            return False, f"engine failure ({self.failure}); {self.restart_status or 'restarting'}{starting}"
        for role, proc in self.procs.items():
            if not proc.is_alive():
                return False, f"{role} process exited (code {proc.exitcode})"
        if not self._all_ready.is_set():
            return False, "starting: waiting for " + self._waiting_for()
        if self.paused:
            return False, PAUSED
        stuck = self.seconds_without_token(oldest_arrival)
        if stuck > self.stall_timeout:
            return False, f"engine stuck: requests in flight and no token for {stuck:.0f} s"
        for s in self._scheduler_stats.values():
            if s.queue_head_fits and s.queue_head_age_seconds > self.queue_stuck_timeout:
                return False, (
                    f"queue stuck on rank {s.dp_rank}: its oldest request has waited "
                    f"{s.queue_head_age_seconds:.0f} s with KV and batch room to admit it"
                )
        return True, "ok"

    def _waiting_for(self) -> str:
        """The children not ready yet, each with the phase of its start under way when it said."""
        return ", ".join(
            f"{role} ({self._starting[role]})" if role in self._starting else role for role in self.missing()
        )

    def seconds_without_token(self, oldest_arrival: int | None) -> float:
        """With requests in flight: seconds since the later of the last token, the oldest arrival and the
        end of the latest in_place pause; 0 while paused in place, or while the tests' hold seam holds a
        request (no token is due)."""
        if oldest_arrival is None or self.paused == "in_place":
            return 0.0
        if any(s.held for s in self._scheduler_stats.values() if s is not None):
            return 0.0
        last = max(oldest_arrival, self.last_token_at or 0, self._resumed_at)
        return (now_ns() - last) / 1e9

    # -- reading it all -------------------------------------------------------------------
    def view(self, front: FrontCounts) -> EngineView:
        """Everything `/metrics` shows about the engine (telemetry.metrics.EngineCollector)."""
        now = now_ns()
        ranks, d = self.ranks_or_zero(), self._detok_stats
        rss, cpu = self._resources()
        return EngineView(
            schedulers=ranks,
            detokenizer=d,
            throughput=self._throughput.rate(now),
            seconds_since_last_token=self.seconds_without_token(front.oldest_arrival),
            stale_drops=self.stale_drops(front),
            undecodable=self._per_component(front.undecodable, "undecodable"),
            handling_errors=self._per_component(front.handling_errors, "handling_errors"),
            heartbeat_age={role: (now - t) / 1e9 for role, t in self._last_heartbeat.items()},
            rss=rss,
            cpu=cpu,
            startup_phases=self.startup_phases(),
            engine_info=[r for r in self._ready.values() if r.role != "detokenizer"],
            decode_gaps=[GapCount(g.cause, g.count, s.dp_rank) for s in ranks for g in s.decode_gaps]
            + merge_gaps(front.decode_gaps, tuple(s.dp_rank for s in ranks)),
        )

    def startup_phases(self) -> list[StartupPhase]:
        """How the latest start of each process went, phase by phase: this one's, then each child's Ready."""
        own = startup_phases.clock()
        return (own.phases() if own is not None else []) + [p for r in self._ready.values() for p in r.startup_phases]

    def ranks(self) -> list[SchedulerStats]:
        return [self._scheduler_stats[r] for r in sorted(self._scheduler_stats)]

    def ranks_or_zero(self) -> list[SchedulerStats]:
        """Every rank's latest stats; zeros for a rank not heard from yet (its series exist from the start)."""
        return [
            self._scheduler_stats.get(r)
            or SchedulerStats(dp_rank=r, num_running=0, num_waiting=0, kv_used=0, kv_reserved=0, kv_total=0)
            for r in range(self.dp_size)
        ]

    def _per_component(self, front: int, name: str) -> dict[str, int]:
        d = self._detok_stats
        return {
            "tokenizer_manager": front,
            "scheduler": sum(getattr(s, name) for s in self._scheduler_stats.values()),
            "detokenizer": getattr(d, name) if d else 0,
        }

    def stale_drops(self, front: FrontCounts) -> list[DropCount]:
        """Stale-drop counters of every process (the children's from their latest stats), ranks summed."""
        drops = list(front.stale_drops)
        for st in [*self._scheduler_stats.values(), self._detok_stats]:
            if st is not None:
                drops += st.stale_drops
        return merge_drops(drops)

    def debug_state(self, front: FrontCounts) -> dict:
        ranks, d = self.ranks(), self._detok_stats
        one = msgspec.to_builtins(ranks[0]) if len(ranks) == 1 and self.dp_size == 1 else (sum_stats(ranks) or None)
        return {
            "ready": sorted(self._ready),
            "scheduler": one,  # with several ranks: their numbers summed
            "schedulers": [msgspec.to_builtins(s) for s in ranks],
            "detokenizer": msgspec.to_builtins(d) if d else None,
            "stale_drops": [msgspec.to_builtins(x) for x in self.stale_drops(front)],
            "undecodable": self._per_component(front.undecodable, "undecodable"),
            "pids": {role: p.pid for role, p in {**self.procs, **self.workers}.items()},
            "ready_rejected": dict(self._ready_rejected),
            "paused": self.paused,
        }

    def _resources(self) -> tuple[dict[str, float], dict[str, float]]:
        rss, cpu = {}, {}
        pids = {
            "main": os.getpid(),
            **{role: p.pid for role, p in {**self.procs, **self.workers}.items() if p.is_alive()},
        }
        for role, pid in pids.items():
            try:
                p = self._ps.get(pid) or self._ps.setdefault(pid, psutil.Process(pid))
                rss[role] = float(p.memory_info().rss)
                t = p.cpu_times()
                cpu[role] = t.user + t.system
            except psutil.Error:
                self._ps.pop(pid, None)
        return rss, cpu
