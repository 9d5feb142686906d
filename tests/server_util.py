"""Start a real `sightline serve` in a subprocess and talk to it over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, *flags: str, model: str = "tiny-random", tmpdir: Path, startup: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = tmpdir
        self.log_path = tmpdir / "server.log"
        extra_env = env or {}
        key = extra_env.get("SIGHTLINE_API_KEY")
        self.auth = {"authorization": f"Bearer {key}"} if key else {}
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env["TMPDIR"] = str(tmpdir)
        env.update(extra_env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving", "serve", "--model", model, "--port", str(self.port), *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        self.wait_healthy(startup)
        self.pids = self.debug()["pids"]
        self.runtime_dir = Path(self.debug()["runtime_dir"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log()}")

    def debug(self) -> dict:
        return httpx.get(self.url + "/debug/state", headers=self.auth, timeout=10).json()

    def post(self, path: str, body: dict | bytes | str, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def sse_events(lines) -> list[dict | str]:
    """Parse SSE `data:` lines into JSON objects, keeping the final "[DONE]" as a string."""
    events: list[dict | str] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate()` until it returns something truthy (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def push_frames(runtime_dir, socket_name: str, *frames: bytes) -> None:
    """Write raw frames onto one of a server's PULL sockets (`scheduler`, `detokenizer`, `tm-sched`,
    `tm-detok`), as any local process of the same user could."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{runtime_dir}/{socket_name}")
    for frame in frames:
        sock.send(frame)
    sock.close(linger=2000)
    ctx.term()


def push(srv: ServerProc, socket_name: str, *msgs) -> None:
    """`push_frames` of our own messages, encoded as the processes encode them."""
    from serving.ipc import Codec

    codec = Codec("test")
    push_frames(srv.runtime_dir, socket_name, *(codec.encode(m) for m in msgs))
