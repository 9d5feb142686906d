"""ZMQ plumbing: the private runtime directory, the endpoints, and the msgpack codec.

Each edge is one PUSH→PULL pair over an `ipc://` path; the receiver binds, the sender
connects (so a restarted sender reconnects without help).  The directory is created
mode 0700 and every socket file is chmod 0600 after bind: only our user can talk to it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec
import zmq

from protocol.io_struct import DropCount, Message
from serving.ratelog import RateLimitedLog
from telemetry.clock import now_ns

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Every socket's `ipc://` address, by role: one per receiver, which binds it.

    Names with one worker and one rank: `scheduler`, `detokenizer`, `tm-detok` (outputs to
    the TokenizerManager), `tm-sched` (control: the children's Ready and stats).  Scheduler
    rank r > 0 listens on `scheduler-{r}`, tokenizer worker w > 0 on `worker-{w}`; with
    several workers the hub owns `tm-sched`.
    """

    runtime_dir: str

    @classmethod
    def create(cls, parent: str | None = None) -> "Endpoints":
        d = tempfile.mkdtemp(prefix="sightline-", dir=parent)  # mkdtemp: mode 0700
        os.chmod(d, 0o700)
        return cls(d)

    def _at(self, name: str) -> str:
        return f"ipc://{self.runtime_dir}/{name}"

    def scheduler_in(self, dp_rank: int = 0) -> str:
        """TokenizerManager (and hub) → Scheduler rank `dp_rank`."""
        return self._at("scheduler" if dp_rank == 0 else f"scheduler-{dp_rank}")

    @property
    def detokenizer_in(self) -> str:
        """Scheduler ranks (and hub) → Detokenizer."""
        return self._at("detokenizer")

    def worker_in(self, worker: int = 0) -> str:
        """Detokenizer (and hub) → tokenizer worker `worker`."""
        return self._at("tm-detok" if worker == 0 else f"worker-{worker}")

    @property
    def control(self) -> str:
        """Children (and workers) → whoever supervises: the TokenizerManager, or the hub."""
        return self._at("tm-sched")

    def cleanup(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def scheduler_role(dp_rank: int, dp_size: int) -> str:
    """A Scheduler rank's process role: `scheduler` with one rank; `scheduler_dp0`, `scheduler_dp1`... with several."""
    return "scheduler" if dp_size == 1 else f"scheduler_dp{dp_rank}"


def engine_roles(dp_size: int) -> list[str]:
    """Every engine process's role: each Scheduler rank's, then the Detokenizer's."""
    return [scheduler_role(r, dp_size) for r in range(dp_size)] + ["detokenizer"]


def bind(sock: zmq.Socket, endpoint: str) -> None:
    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, do_bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, 256 * 1024 * 1024)  # refuse absurd frames outright
    (bind(sock, endpoint) if do_bind else sock.connect(endpoint))
    return sock


class Codec:
    """msgpack encode/decode of `io_struct.Message`; counts what it cannot decode."""

    def __init__(self, component: str) -> None:
        self.component = component
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)
        self.undecodable = 0
        self._log = RateLimitedLog(log, level=logging.WARNING)  # a flood of garbage logs a line a second

    def encode(self, msg: Message) -> bytes:
        msg.sent_at = now_ns()
        return self._enc.encode(msg)

    def decode(self, data: bytes) -> Message | None:
        """The message, or None (counted and logged) when it is not one of ours."""
        try:
            return self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.undecodable += 1
            self._log.report(f"{self.component}: dropped an undecodable message of {len(data)} bytes: {exc}")
            return None


class DropCounter:
    """Stale-message drops by (component, message_type, reason); cumulative.

    The reason says why the rid is unknown: what ended it here (`forget`), remembered
    for the last few thousand rids, or `unknown_rid` when it was never seen.
    """

    def __init__(
        self, component: str, remember: int = 4096, on_drop: Callable[[dict | None, str, str, str], None] | None = None
    ) -> None:
        self.component = component
        self.on_drop = on_drop  # (carrier, component, message_type, reason): the stale-drop span
        self.counts: Counter[tuple[str, str]] = Counter()
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._remember = remember

    def forget(self, rid: str, reason: str) -> None:
        """Record that `rid` ended here (finished, aborted, ...)."""
        self._gone[rid] = reason
        if len(self._gone) > self._remember:
            self._gone.popitem(last=False)

    def drop(self, message_type: str, rid: str, carrier: dict | None = None) -> str:
        reason = self._gone.get(rid, "unknown_rid")
        self.counts[(message_type, reason)] += 1
        if self.on_drop is not None:
            self.on_drop(carrier, self.component, message_type, reason)
        return reason

    def total(self) -> int:
        return sum(self.counts.values())

    def snapshot(self) -> list[DropCount]:
        return [DropCount(self.component, t, r, n) for (t, r), n in sorted(self.counts.items())]


def runtime_parent() -> str | None:
    """Where runtime dirs go: $XDG_RUNTIME_DIR when usable (tmpfs, per user), else $TMPDIR."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return xdg if xdg and Path(xdg).is_dir() and os.access(xdg, os.W_OK) else None
