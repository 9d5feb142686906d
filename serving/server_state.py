"""What the HTTP handlers share: the TokenizerManager, the child processes, health."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from serving.args import ServerArgs
from serving.errors import APIError
from serving.ipc import Endpoints
from serving.tokenizer_manager import TokenizerManager


@dataclass
class ServerState:
    args: ServerArgs
    tm: TokenizerManager
    model_name: str
    endpoints: Endpoints
    procs: dict[str, BaseProcess] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): ready, both children alive, not shutting down."""
        if self.shutting_down:
            return False, "shutting down"
        for role, proc in self.procs.items():
            if not proc.is_alive():
                return False, f"{role} process exited (code {proc.exitcode})"
        if not self.tm.all_ready.is_set():
            return False, "starting: waiting for " + ", ".join(sorted({"scheduler", "detokenizer"} - self.tm.ready.keys()))
        return True, "ok"

    def check_available(self) -> None:
        ok, reason = self.health()
        if not ok:
            raise APIError(503, f"server unavailable: {reason}", type="server_unavailable")

    def describe(self) -> dict:
        return {"pids": {role: p.pid for role, p in self.procs.items()}, "runtime_dir": self.endpoints.runtime_dir,
                "model": self.model_name}
