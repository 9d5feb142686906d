"""Crash dumps: what was going on when an engine process died or stalled.

On each engine failure the supervisor calls `begin` (before the in-flight requests are
failed: their state and the children's last stats are taken as they were) and `finish`
(before the children are killed: every live child is asked for its Python stacks).  The
dump is then written by a background thread to `DIR/crash-<UTC time>/` (DIR: `--crash-dump-dir`,
else `--dump-requests`), first under a hidden name, renamed once complete:

* `failure.json`: role, cause, detail, exit code and signal name, pid, time; what is missing;
* `requests.jsonl`: the last `--crash-dump-requests` request records (`RequestRecord`),
  those just failed by the crash included;
* `stats.json`: the last Scheduler (every rank) and Detokenizer stats the `EngineMonitor` held,
  heartbeat ages, pids;
* `in_flight.json`: the requests in flight (rid, route, queued/running, age, tokens so far);
* `stacks/<role>-<pid>.txt`: each live child's stacks (faulthandler, `serving.process.
  enable_stack_dumps`; a stopped process is continued so it can answer — it is killed
  next anyway) and this process's own.  A SIGKILLed child has none.

With several tokenizer workers the hub supervises the engine but holds no requests: the
in-flight list is asked of the workers (`/debug/requests?in_flight=1`'s query) and the
records are read back from the workers' `requests-w*.jsonl` files (none without
`--dump-requests`).  Any error is logged and counted (`sightline_crash_dumps_total{result}`)
and never delays the restart by more than the stack wait.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec
import psutil

from serving.process import STACK_SIGNAL, stack_file
from telemetry.request_record import FILE_GLOB

log = logging.getLogger("sightline.crash_dump")
STACK_WAIT = 2.0  # seconds the live children have to write their stacks
KEPT = 20  # crash-* directories kept; the oldest go
TAIL_BYTES = 4 << 20  # of each workers' request file, read back for a hub's dump


@dataclass
class Pending:
    failure: dict
    stats: dict
    in_flight: list | Awaitable[list] | None
    missing: list[str] = field(default_factory=list)
    stacks: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (source file, offset)


class CrashDumper:
    def __init__(
        self,
        directory: str,
        monitor: Any,
        runtime_dir: str,
        metrics: Any = None,
        *,
        recorder: Any = None,
        in_flight: Callable[[], list] | None = None,
        in_flight_async: Callable[[], Awaitable[list]] | None = None,
        records_dir: str | None = None,
        records: int = 200,
        role: str = "main",
    ) -> None:
        self.dir, self.monitor, self.runtime_dir, self.m = Path(directory), monitor, runtime_dir, metrics
        self.recorder, self.in_flight, self.in_flight_async = recorder, in_flight, in_flight_async
        self.records_dir, self.records, self.role = records_dir, records, role
        self.threads: list[threading.Thread] = []

    @classmethod
    def from_args(cls, args: Any, monitor: Any, runtime_dir: str, metrics: Any = None, **kw) -> "CrashDumper | None":
        directory = args.crash_dump_dir or args.dump_requests
        return (
            cls(directory, monitor, runtime_dir, metrics, records=args.crash_dump_requests, **kw) if directory else None
        )

    async def begin(self, role: str, cause: str, detail: str) -> Pending | None:
        """Take what the failure will erase: the children's last stats and the requests in flight."""
        try:
            mon, now = self.monitor, time.monotonic_ns()
            proc = mon.procs.get(role)
            code = proc.exitcode if proc is not None else None
            failure = {
                "role": role,
                "cause": cause,
                "detail": detail,
                "time": _utc(time.time(), "%Y-%m-%dT%H:%M:%S.%fZ"),
                "pid": proc.pid if proc is not None else None,
                "exit_code": code,
                "signal": signal.Signals(-code).name if code is not None and code < 0 else None,
                "restart_status": mon.restart_status,
            }
            stats = {
                "schedulers": [msgspec.to_builtins(s) for s in mon.ranks()],
                "detokenizer": msgspec.to_builtins(mon.detok_stats) if mon.detok_stats else None,
                "heartbeat_age_seconds": {r: round((now - t) / 1e9, 3) for r, t in mon.last_heartbeat.items()},
                "pids": {r: p.pid for r, p in mon.procs.items()},
            }
            pending = Pending(failure, stats, None)
            if self.in_flight is not None:
                pending.in_flight = self.in_flight()
            elif self.in_flight_async is not None:  # asked now, before the workers hear of the failure
                pending.in_flight = asyncio.ensure_future(self.in_flight_async())
                await asyncio.sleep(0)
            return pending
        except Exception:
            log.exception("crash dump: could not take the engine's state")
            self._count("failed")
            return None

    async def finish(self, pending: Pending | None) -> None:
        """Ask the live children for their stacks (at most STACK_WAIT), then write it all in a thread."""
        if pending is None:
            return
        try:
            await self._stacks(pending)
            if isinstance(pending.in_flight, asyncio.Future):
                try:
                    pending.in_flight = await asyncio.wait_for(pending.in_flight, 3.0)
                except Exception:  # noqa: BLE001
                    pending.in_flight = None
                    pending.missing.append("in_flight: the workers did not answer")
            records = self.recorder.recent() if self.recorder is not None else None
            t = threading.Thread(target=self._write, args=(pending, records), name="crash-dump", daemon=True)
            t.start()
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        except Exception:
            log.exception("crash dump: failed")
            self._count("failed")

    def join(self, timeout: float = 5.0) -> None:
        """At shutdown: let a dump being written finish (its thread is a daemon)."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    async def _stacks(self, pending: Pending) -> None:
        sources: dict[str, tuple[str, int]] = {}
        for role, p in self.monitor.procs.items():
            path = stack_file(self.runtime_dir, p.pid)
            if not p.is_alive() or not os.path.exists(path):
                continue
            try:
                offset = os.path.getsize(path)
                os.kill(p.pid, STACK_SIGNAL)
                if psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
                    os.kill(p.pid, signal.SIGCONT)  # it is killed right after this
                sources[f"{role}-{p.pid}"] = (path, offset)
            except (OSError, psutil.Error):
                continue
        deadline, sizes = time.monotonic() + STACK_WAIT, {}
        while sources and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            now = {k: _size(path) for k, (path, _) in sources.items()}
            if all(now[k] > off for k, (_, off) in sources.items()) and now == sizes:
                break  # every one wrote, and nothing more since the last look
            sizes = now
        pending.stacks = sources
        dead = [f"{r} (pid {p.pid})" for r, p in self.monitor.procs.items() if not p.is_alive()]
        if dead:
            pending.missing.append("stacks of " + ", ".join(dead) + ": not running")

    def _write(self, pending: Pending, records: list | None) -> None:
        """The thread: write the dump under a hidden name, rename it when complete, prune old ones."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            name = "crash-" + _utc(time.time(), "%Y%m%dT%H%M%S.%fZ")
            tmp = self.dir / f".{name}.partial"
            (tmp / "stacks").mkdir(parents=True)
            if records is not None:
                lines = [self.recorder.line(item) for item in records]
            elif self.records_dir is not None:
                lines = _records_from_files(Path(self.records_dir), self.records)
                pending.missing.append(
                    "requests: read back from the workers' request files (those still queued in a worker are not in it)"
                )
            else:
                lines = []
                pending.missing.append("requests: held by the tokenizer workers; set --dump-requests to have them")
            (tmp / "requests.jsonl").write_bytes(b"".join(lines))
            (tmp / "stats.json").write_text(json.dumps(pending.stats, indent=1, default=str))
            (tmp / "in_flight.json").write_text(json.dumps({"requests": pending.in_flight}, indent=1))
            for key, (path, offset) in pending.stacks.items():
                with open(path, "rb") as f:
                    f.seek(offset)
                    (tmp / "stacks" / f"{key}.txt").write_bytes(f.read())
            with open(tmp / "stacks" / f"{self.role}-{os.getpid()}.txt", "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
            (tmp / "failure.json").write_text(json.dumps({**pending.failure, "missing": pending.missing}, indent=1))
            os.rename(tmp, self.dir / name)
            self._prune()
            log.warning("crash dump written to %s", self.dir / name)
            self._count("written")
        except Exception:
            log.exception("crash dump: could not write it to %s", self.dir)
            self._count("failed")

    def _prune(self) -> None:
        dumps = sorted(d for d in self.dir.glob("crash-*") if d.is_dir())
        for d in dumps[: max(0, len(dumps) - KEPT)]:
            shutil.rmtree(d, ignore_errors=True)

    def _count(self, result: str) -> None:
        if self.m is not None:
            self.m.crash_dumps.labels(result).inc()


def _utc(t: float, fmt: str) -> str:
    return time.strftime(fmt.replace("%f", f"{int(t % 1 * 1000):03d}"), time.gmtime(t))


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _records_from_files(directory: Path, n: int) -> list[bytes]:
    """The last `n` records (by arrival) of the request files in `directory`, read from their tails."""
    found: list[tuple[float, bytes]] = []
    for f in directory.glob(FILE_GLOB):
        try:
            with f.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - TAIL_BYTES))
                data = fh.read()
        except OSError:
            continue
        lines = data.split(b"\n")
        for line in lines[1:] if size > TAIL_BYTES else lines:
            try:
                found.append((json.loads(line)["arrival"], line + b"\n"))
            except (ValueError, KeyError, TypeError):
                continue
    found.sort(key=lambda x: x[0])
    return [line for _, line in found[-n:]] if n else []
