"""The client libraries' own interpreter (.venv-clients, tests/clients/requirements.txt: `make setup` builds
it), running the scenarios of tests/clients/drive.py against a live server.

One `drive.py --serve` process answers every scenario of a test run, one after another: its libraries
(openai, instructor, LangChain, the Agents SDK, anthropic: 1-2.5 s of CPU each to import) are imported
once, not once a scenario. A scenario that does not answer in time has its process killed (the next
scenario starts a fresh one) and fails its test.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLIENTS_PY = ROOT / ".venv-clients" / "bin" / "python"
DRIVE = ROOT / "tests" / "clients" / "drive.py"
SCENARIO_TIMEOUT_S = 100.0  # under the e2e tests' 120 s, so a hung client fails here, with its stderr


def need_clients_venv() -> None:
    if not CLIENTS_PY.exists():
        message = f"{CLIENTS_PY} is missing: `make setup` builds it from tests/clients/requirements.txt"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


class _Driver:
    """The one `drive.py --serve` process, its stdout read by a thread so that a wait can time out."""

    def __init__(self) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "PYTHON"))}
        self.proc = subprocess.Popen(
            [str(CLIENTS_PY), str(DRIVE), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line)

    def ask(self, scenario: str, base_url: str, env: dict[str, str] | None) -> dict:
        self.proc.stdin.write(json.dumps({"scenario": scenario, "base_url": base_url, "env": env or {}}) + "\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self.lines.get(timeout=SCENARIO_TIMEOUT_S))
        except queue.Empty:
            self.stop()
            raise AssertionError(
                f"{scenario}: no answer in {SCENARIO_TIMEOUT_S} s; stderr: {''.join(self.stderr)[-3000:]}"
            ) from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


_driver: _Driver | None = None
_lock = threading.Lock()


def _stop_driver() -> None:
    if _driver is not None and _driver.alive():
        _driver.proc.stdin.close()
        _driver.stop()


atexit.register(_stop_driver)


def drive(base_url: str, scenario: str, env: dict[str, str] | None = None) -> dict:
    """What the scenario's client returned (drive.py's JSON answer); `env`: e.g. the key a client reads."""
    global _driver
    with _lock:
        if _driver is None or not _driver.alive():
            _driver = _Driver()
        result = _driver.ask(scenario, base_url, env)
    assert result["ok"], result["error"]
    return result
