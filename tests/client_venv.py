"""The client libraries' own interpreter (.venv-clients, tests/clients/requirements.txt: `make setup` builds
it), running one scenario of tests/clients/drive.py against a live server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLIENTS_PY = ROOT / ".venv-clients" / "bin" / "python"
DRIVE = ROOT / "tests" / "clients" / "drive.py"


def need_clients_venv() -> None:
    if not CLIENTS_PY.exists():
        message = f"{CLIENTS_PY} is missing: `make setup` builds it from tests/clients/requirements.txt"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def drive(base_url: str, scenario: str, env: dict[str, str] | None = None) -> dict:
    """What the scenario's client returned (drive.py's one JSON line); `env`: e.g. the key a client reads."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "PYTHON"))}
    proc = subprocess.run([str(CLIENTS_PY), str(DRIVE), scenario, base_url], capture_output=True, text=True,
                          timeout=120, env={**clean, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result["error"]
    return result
