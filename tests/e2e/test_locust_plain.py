"""loadtest/locustfile.py under plain Locust, the way a Locust user starts it, against a real tiny-random server.

Locust's own `locust` command, run from a directory outside the repo with no plan and no
SIGHTLINE_LOADTEST_PLAN: headless (~10 s: 2 users for 8 s, its CSV must hold the custom
TTFT/ITL/TPOT/E2E/GOODPUT rows); headless with an impossible SLO (~6 s: exit code 1 and the
misses in the failures table); and the web UI (~10 s: the page, the custom arguments in its
form, a swarm started through /swarm whose form values reach the users, then a stop).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtest.server import free_port
from tests.server_util import wait_until

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
CONFIG = """
workloads:
  small: {endpoint: completions, prompt_tokens: [16, 32], max_tokens: 8, ignore_eos: true}
"""


def locust_cmd() -> list[str]:
    """The venv's `locust` script when there is one (what users type), else `python -m locust`."""
    script = Path(sys.executable).with_name("locust")
    return [str(script)] if script.exists() else [sys.executable, "-m", "locust"]


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SIGHTLINE_LOADTEST_PLAN", "PYTHONPATH")}


@pytest.fixture
def cfg(tmp_path) -> Path:
    (tmp_path / "workloads.yaml").write_text(CONFIG)
    return tmp_path / "workloads.yaml"


def headless(server, cfg: Path, *args: str, seconds: int = 8) -> subprocess.CompletedProcess:
    cmd = [
        *locust_cmd(),
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        "2",
        "-r",
        "2",
        "-t",
        f"{seconds}s",
        "--host",
        server.url,
        "--workload",
        "small",
        "--workloads-config",
        str(cfg),
        *args,
    ]
    return subprocess.run(cmd, cwd=cfg.parent, env=plain_env(), capture_output=True, text=True, timeout=90)


def stats_rows(prefix: Path) -> dict[tuple[str, str], dict]:
    return {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}


def test_headless_run_fills_the_custom_rows(server, cfg):
    prefix = cfg.parent / "run"
    proc = headless(
        server,
        cfg,
        "--csv",
        str(prefix),
        "--records",
        str(cfg.parent / "records.jsonl"),
        "--slo-ttft",
        "60000",
        "--slo-tpot",
        "60000",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = stats_rows(prefix)
    for kind in ("TTFT", "ITL", "TPOT", "E2E", "TOKENS", "GOODPUT"):
        assert int(rows[kind, "small"]["Request Count"]) > 0, kind
        assert int(rows[kind, "small"]["Failure Count"]) == 0, kind
    e2e = int(rows["E2E", "small"]["Request Count"])
    assert int(rows["TTFT", "small"]["Request Count"]) == int(rows["GOODPUT", "small"]["Request Count"]) == e2e
    assert (
        float(rows["TOKENS", "small"]["Min Response Time"]) == float(rows["TOKENS", "small"]["Max Response Time"]) == 8
    )
    assert (
        0 < float(rows["TTFT", "small"]["Median Response Time"]) < float(rows["E2E", "small"]["Median Response Time"])
    )
    assert list(csv.DictReader(open(f"{prefix}_failures.csv"))) == []
    recs = [json.loads(line) for line in (cfg.parent / "records.jsonl").read_text().splitlines()]
    assert sum(r["error"] is None for r in recs) == e2e  # cut at the end: recorded, not reported to Locust
    assert {r["level"] for r in recs} == {2.0}
    assert f"SLO PASS: {e2e} of {e2e} requests (100.0%)" in proc.stdout
    assert "ttft ≤ 60000 ms, tpot ≤ 60000 ms" in proc.stdout


def test_headless_run_under_its_slo_objective_exits_1(server, cfg):
    prefix = cfg.parent / "tight"
    proc = headless(server, cfg, "--csv", str(prefix), "--slo-ttft", "0.001", seconds=4)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SLO FAIL: 0 of" in proc.stdout
    rows = stats_rows(prefix)
    assert rows["GOODPUT", "small"]["Failure Count"] == rows["GOODPUT", "small"]["Request Count"] != "0"
    assert rows["E2E", "small"]["Failure Count"] == "0"  # the requests themselves succeeded
    failures = list(csv.DictReader(open(f"{prefix}_failures.csv")))
    assert [(f["Method"], f["Error"]) for f in failures] == [("GOODPUT", "RequestFailed('ttft > 0.001 ms')")]


def test_unknown_workload_stops_before_any_load(server, cfg):
    proc = headless(server, cfg, "--workload", "nope", seconds=2)
    assert proc.returncode == 2 and "no workload nope" in proc.stderr


def test_web_ui_serves_and_swarms_with_the_form_values(server, cfg):
    port = free_port()
    ui = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            *locust_cmd(),
            "-f",
            str(LOCUSTFILE),
            "--host",
            server.url,
            "--web-host",
            "127.0.0.1",
            "--web-port",
            str(port),
            "--workloads-config",
            str(cfg),
            "--workload",
            "small",
        ],
        cwd=cfg.parent,
        env=plain_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def page():
            try:
                r = httpx.get(ui + "/", timeout=2)
                return r if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        r = wait_until(lambda: proc.poll() is not None or page(), 30, "the Locust web UI")
        assert proc.poll() is None, proc.communicate()[0]
        assert "Locust" in r.text
        for arg in ("workload", "slo_ttft", "slo_tpot", "slo_objective"):  # the custom arguments' form fields
            assert f'"{arg}"' in r.text, arg
        swarm = httpx.post(
            ui + "/swarm",
            data={
                "user_count": 1,
                "spawn_rate": 1,
                "host": server.url,
                "workload": "small",
                "slo_ttft": 55555,
                "slo_tpot": 44444,
            },
            timeout=10,
        ).json()
        assert swarm["success"], swarm

        def rows():
            stats = httpx.get(ui + "/stats/requests", timeout=5).json()["stats"]
            got = {(s["method"], s["name"]): s for s in stats}
            return got if all(got.get((k, "small"), {}).get("num_requests", 0) > 1 for k in ("E2E", "TTFT")) else None

        got = wait_until(rows, 20, "TTFT and E2E rows in the web UI's stats", interval=0.5)
        for kind in ("TTFT", "ITL", "TPOT", "E2E", "GOODPUT"):
            assert got[kind, "small"]["num_requests"] > 0 and got[kind, "small"]["num_failures"] == 0, kind
        assert httpx.post(ui + "/stop", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
    assert proc.returncode == 0, output
    assert "SLO PASS" in output and "ttft ≤ 55555 ms, tpot ≤ 44444 ms" in output, output
