"""The chaos soak's short form (the long one: python -m loadtest.chaos --seconds 600): 2 workers x
2 ranks under mixed streaming load while a worker, a rank and the Detokenizer are SIGKILLed;
every request ends (a result or an explicit error) within its deadline, the outcomes sum to the
requests sent, nothing stays in flight or holds KV, memory stays flat, and the server exits 0."""

from __future__ import annotations

import re
import subprocess
import sys


def test_kills_under_load_lose_and_hang_nothing():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.chaos",
            "--seconds",
            "18",
            "--users",
            "6",
            "--min-gap",
            "1",
            "--max-gap",
            "3",
            "--overlap",
            "--max-faults",
            "3",
            "--warmup",
            "3",
            "--interval",
            "2",
            "--max-growth",
            "0.25",
            "--deadline",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-3000:]
    assert "chaos passed: hung 0, lost 0, idle after the load True" in out, out
    faults = re.search(r"faults injected: \d+ \(worker (\d+), rank (\d+), detokenizer (\d+)\)", out)
    assert faults and all(int(n) >= 1 for n in faults.groups()), out
    [line] = [x for x in out.splitlines() if re.match(r"requests \d+: ", x)]
    sent, counts = line.split(": ", 1)
    outcomes = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", counts)}
    sent = int(sent.split()[1])
    assert sum(outcomes.values()) == sent and outcomes.get("ok", 0) > 0, out
    assert "RSS main (pid hub)" in out and "server exit code 0" in out, out
