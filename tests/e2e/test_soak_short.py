"""A short soak in CI (the real one is 30 minutes: python -m loadtest.soak --minutes 30)."""

from __future__ import annotations

import subprocess
import sys


def test_short_soak_keeps_memory_flat_and_serves_without_5xx(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.soak",
            "--model",
            "tiny-random",
            "--minutes",
            "0.34",
            "--warmup",
            "0.1",
            "--interval",
            "3",
            "--users",
            "6",
            "--max-growth",
            "0.25",
            "--port",
            "8394",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("[")]
    assert len(lines) >= 5 and all("RSS " in line and "main=" in line for line in lines), res.stdout
    for role in ("main", "scheduler", "detokenizer"):
        assert f"RSS {role}:" in res.stdout, res.stdout
    assert "soak passed" in res.stdout
