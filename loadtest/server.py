"""A local `python -m serving serve` for the run, and what the client needs to know about a server.

The server's log goes to `server.log` in the results folder; it is stopped with
SIGTERM (its clean shutdown) and killed only if that takes too long.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServerFacts:
    model: str  # the served name (`model` in requests, `model_name` in metrics)
    max_model_len: int | None


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $SIGHTLINE_API_KEY` when the variable is set (a server started here
    inherits it too); the key is read from the environment only, never written to the results."""
    key = os.environ.get("SIGHTLINE_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


def facts(url: str) -> ServerFacts:
    data = httpx.get(url + "/v1/models", headers=auth_headers(), timeout=10).raise_for_status().json()["data"][0]
    return ServerFacts(data["id"], data.get("max_model_len"))


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health was not 200 within {timeout:g} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`python -m serving serve --model M --port P [extra flags]`, healthy on return.

    The one way a real server is started, by the load-test tools and by the test suite
    (tests/server_util.ServerProc adds its conveniences on top).
    """

    def __init__(
        self,
        model: str,
        port: int,
        log_path: Path,
        extra: list[str],
        startup_s: float = 900.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "serving",
                "serve",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra,
            ],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            self.wait_healthy(startup_s)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        """Until /health is 200; if the server exits or never gets there, the error quotes its log."""
        try:
            wait_healthy(self.url, timeout, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}; its log ends with:\n{self.log()[-6000:]}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """`sig` (SIGTERM: a clean shutdown, in-flight requests end with an error event); the whole
        process group is killed only if it has not exited after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            self._log.close()


def target(url: str | None, model: str, port: int, log_path: Path, extra: list[str]) -> tuple[str, LocalServer | None]:
    """The server a load-test run drives: `url` once it is healthy, else a fresh LocalServer of
    `model` (returned too, for the caller to stop)."""
    if url:
        url = url.rstrip("/")
        wait_healthy(url, 30)
        return url, None
    print(f"starting {model} (log: {log_path}) ...", flush=True)
    server = LocalServer(model, port, log_path, extra)
    return server.url, server
