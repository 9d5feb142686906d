"""`python -m loadtest` end to end: one short headless Locust run against a real tiny-random server.

One run (~16 s: 2 then 4 users) of three workloads — chat, a completions workload pinned
to 8 tokens with ignore_eos, and one whose prompt overflows the context (a 400 by design,
so failures and their reasons are exercised) — then every assertion reads what it left:
Locust's CSV, summary.json, the plots, the reconciliation, and the SLO gate re-judged
with an impossible and a loose threshold.  The test scrapes /metrics itself too, so the
reconciliation is checked against numbers the tool did not compute.  A second short run
on the same server (~8 s, 3 users) of a shared-prefix chat workload (one ~1,000-token
system prompt) checks the prefix cache from the client: hit ratio ≥ 0.9, and the usage
chunks' cached_tokens equal to the increase of the server's hits counter.  A goodput search
(~25 s: four steps of 2 s, each its own Locust run) on the same server checks the found rate,
the per-step goodput, slo.yaml's thresholds as its defaults, and the knee the plot drew.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import matplotlib.image
import pytest
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
workloads:
  chat: {endpoint: chat, max_tokens: [4, 24]}
  fixed: {endpoint: completions, prompt_tokens: [16, 64], max_tokens: 8, ignore_eos: true}
  oversize: {endpoint: completions, prompt_tokens: 2100, max_tokens: 4}
scenarios:
  test:
    mix: {chat: 4, fixed: 4, oversize: 1}
    arrival: closed
    shape: {kind: sweep, levels: [2, 4], stage_seconds: 8}
    slo: {ttft_p99_ms: 120000, error_rate: 0.6}
goodput: {ttft_ms: 60000, tpot_ms: 60000}
"""


def loadtest(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loadtest", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def requests_by_finish_reason(exposition: str, model: str) -> Counter:
    out: Counter = Counter()
    for fam in text_string_to_metric_families(exposition):
        for s in fam.samples:
            if s.name == "sightline_requests_total" and s.labels["model_name"] == model:
                out[s.labels["finish_reason"]] += int(s.value)
    return out


@pytest.fixture(scope="module")
def run(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loadtest")
    (tmp / "cfg.yaml").write_text(CONFIG)
    # seed 0: the third user's first request is `oversize` (workloads are drawn from per-user
    # seeded generators), so the run always has a failure however fast the machine is
    proc = loadtest(
        "--url",
        server.url,
        "--config",
        str(tmp / "cfg.yaml"),
        "--scenario",
        "test",
        "--seed",
        "0",
        "--out",
        str(tmp / "out"),
        "--require-reconcile",
        timeout=300,
    )
    after = requests_by_finish_reason(httpx.get(server.url + "/metrics", timeout=10).text, "tiny-random")
    # the tool's scrape from just before Locust started (after its warm-up requests), parsed here
    before = requests_by_finish_reason((tmp / "out" / "metrics_before.txt").read_text(), "tiny-random")
    return tmp / "out", proc, after - before


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_run_passes_its_loose_gate_and_writes_the_folder(run):
    out, proc, _ = run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in (
        "locust_stats.csv",
        "locust_failures.csv",
        "locust.html",
        "summary.json",
        "plan.json",
        "records.jsonl",
        "metrics_before.txt",
        "metrics_after.txt",
        "report.txt",
    ):
        assert (out / name).stat().st_size > 0, name
    assert "SLO gate: PASS" in proc.stdout


def test_csv_holds_the_custom_rows(run):
    out, _, _ = run
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(out / "locust_stats.csv"))}
    recs = records(out)
    for workload in ("chat", "fixed"):
        ok = [r for r in recs if r["workload"] == workload and r["error"] is None]
        assert len(ok) >= 3, workload
        assert int(rows["E2E", workload]["Request Count"]) == len(ok)
        for kind in ("TTFT", "ITL", "TPOT", "TOKENS"):
            assert int(rows[kind, workload]["Request Count"]) > 0, (kind, workload)
        assert int(rows["ITL", workload]["Request Count"]) == sum(len(r["chunk_times"]) - 1 for r in ok)
        ttft, e2e = (float(rows[kind, workload]["Median Response Time"]) for kind in ("TTFT", "E2E"))
        assert 0 < ttft < e2e < 60_000
        goodput = rows["GOODPUT", workload]  # every success, none out of the loose goodput SLO
        assert (int(goodput["Request Count"]), int(goodput["Failure Count"])) == (len(ok), 0)
    fixed = rows["TOKENS", "fixed"]  # ignore_eos pins the output length
    assert float(fixed["Min Response Time"]) == float(fixed["Max Response Time"]) == 8
    assert rows["E2E", "oversize"]["Failure Count"] == rows["E2E", "oversize"]["Request Count"] != "0"
    failures = list(csv.DictReader(open(out / "locust_failures.csv")))
    assert [(f["Name"], f["Error"]) for f in failures] == [
        ("oversize", "RequestFailed('http 400 context_length_exceeded')")
    ]


def test_summary_numbers_are_consistent(run):
    out, _, _ = run
    s = json.loads((out / "summary.json").read_text())
    recs = records(out)
    assert s["requests"] == len(recs) and s["failures"] == sum(r["error"] is not None for r in recs) > 0
    assert s["failure_reasons"] == {"http 400 context_length_exceeded": s["failures"]}
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = s["latency"][name]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"] <= p["max"], name
    assert s["latency"]["ttft_ms"]["p50"] < s["latency"]["e2e_ms"]["p50"]
    assert s["output_tokens"] == sum(r["completion_tokens"] for r in recs if r["error"] is None)
    assert s["output_tokens_per_s"] > 0 and 0 < s["goodput_per_s"] <= s["requests_per_s"]
    assert [st["level"] for st in s["stages"]] == [2, 4]
    assert s["slo_gate"]["passed"] and {c["name"] for c in s["slo_gate"]["checks"]} == {
        "ttft_p99_ms",
        "error_rate",
        "reconciliation",
    }


def test_client_and_server_counts_reconcile(run):
    out, _, server_delta = run
    recs = records(out)
    client = Counter(r["finish_reason"] for r in recs)
    assert client["error"] > 0 and client["length"] > 0
    assert +server_delta == client  # scraped by this test, independently of the tool
    r = json.loads((out / "summary.json").read_text())["reconciliation"]
    assert r["available"] and r["ok"], r
    assert r["server_by_finish_reason"] == dict(client)
    assert (
        r["server_generation_tokens"]
        == r["client_generation_tokens"]
        == sum(x["completion_tokens"] for x in recs if x["error"] is None)
    )
    assert r["server_ttft_count"] == r["client_ttft_count"] and r["server_ttft_le_client"]
    assert r["ttft_ms"]["p50"]["server_estimate"] > 0


def test_plots_are_valid_pngs(run):
    out, _, _ = run
    plots = json.loads((out / "summary.json").read_text())["plots"]
    assert sorted(plots) == ["latency_cdf.png", "load_vs_latency.png", "throughput.png"]
    for name in plots:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200 and img.std() > 0


def test_gate_fails_an_impossible_slo_and_passes_a_loose_one(run):
    out, _, _ = run
    strict = loadtest("--gate-only", str(out), "--slo", "ttft_p50_ms=0.001")
    assert strict.returncode == 1 and "FAIL  ttft_p50_ms" in strict.stdout, strict.stdout + strict.stderr
    loose = loadtest("--gate-only", str(out), "--slo", "ttft_p50_ms=600000", "--slo", "goodput_min=0.01")
    assert loose.returncode == 0, loose.stdout + loose.stderr


def test_bad_arguments_exit_2_before_sending_anything(tmp_path):
    proc = loadtest("--url", "http://127.0.0.1:9", "--slo", "ttft_p98_ms=5", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "unknown SLO" in proc.stderr
    assert not (tmp_path / "x").exists()


PREFIX_CONFIG = """
workloads:
  shared: {endpoint: chat, system_prompt_tokens: 1000, max_tokens: 8, temperature: 0}
scenarios:
  prefix:
    mix: {shared: 1}
    arrival: closed
    shape: {kind: constant, level: 3, seconds: 8}
"""
HITS = "sightline_prefix_cache_hits_tokens_total"


def counter(exposition: str, name: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(exposition)
        for s in fam.samples
        if s.name == name and s.labels.get("model_name") == "tiny-random"
    )


def test_shared_prefix_run_hits_the_cache_and_reconciles_cached_tokens(server, tmp_path):
    (tmp_path / "cfg.yaml").write_text(PREFIX_CONFIG)
    out = tmp_path / "out"
    proc = loadtest(
        "--url",
        server.url,
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--scenario",
        "prefix",
        "--out",
        str(out),
        "--require-reconcile",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hits = counter(httpx.get(server.url + "/metrics", timeout=10).text, HITS) - counter(
        (out / "metrics_before.txt").read_text(), HITS
    )
    recs = records(out)
    assert len(recs) >= 3 and all(r["error"] is None for r in recs)
    cached = [r["cached_tokens"] for r in recs]
    assert all(c is not None and c >= 1000 for c in cached), cached  # the warm-up cached the system prompt
    assert sum(cached) == hits  # scraped by this test, independently of the tool
    r = json.loads((out / "summary.json").read_text())["reconciliation"]
    assert r["ok"] and r["prefix_cache_available"] and r["cached_tokens_match"], r
    assert r["client_cached_tokens"] == r["server_prefix_hits_tokens"] == sum(cached)
    assert r["prefix_hit_ratio"] >= 0.9
    assert "prefix cache hit ratio:" in proc.stdout
    rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(open(out / "locust_stats.csv"))}
    assert int(rows["CACHED", "shared"]["Request Count"]) == len(recs)


SEARCH_CONFIG = """
workloads:
  small: {endpoint: completions, prompt_tokens: [16, 32], max_tokens: 8, ignore_eos: true}
scenarios:
  knee:
    mix: {small: 1}
    arrival: poisson
    search: {start: 2, factor: 4, max_level: 512, max_steps: 4, step_seconds: 2, precision: 0.25}
"""


def slo_yaml_goodput() -> tuple[dict[str, float], float]:
    """The TTFT/TPOT thresholds (ms) and objective of dashboards/slo.yaml, read here independently."""
    slos = yaml.safe_load((REPO / "dashboards" / "slo.yaml").read_text())["slos"]
    return (
        {f"{n}_ms": slos[n]["sli"]["latency"]["threshold"] * 1000 for n in ("ttft", "tpot")},
        max(slos[n]["objective"] for n in ("ttft", "tpot")),
    )


def _judged(server) -> dict[tuple[str, str], float]:
    """Requests the server judged against their objectives so far, by (objective, met) (`all`: every one)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        (slo, met): sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "sightline_request_slo_total" and s.labels == {**s.labels, "slo": slo, "met": met}
        )
        for slo in ("all", "ttft")
        for met in ("true", "false")
    }


def test_goodput_search_finds_the_knee_with_slo_yaml_thresholds(server, tmp_path):
    (tmp_path / "cfg.yaml").write_text(SEARCH_CONFIG)
    out = tmp_path / "out"
    judged_before = _judged(server)
    proc = loadtest(
        "--url",
        server.url,
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--scenario",
        "knee",
        "--out",
        str(out),
        "--require-reconcile",
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    judged = {key: n - judged_before[key] for key, n in _judged(server).items()}
    s = json.loads((out / "summary.json").read_text())
    g = s["goodput_search"]
    thresholds, objective = slo_yaml_goodput()
    assert g["goodput_slo"] == thresholds and g["objective"] == objective and g["unit"] == "requests/s"
    steps = g["steps"]
    assert 2 <= len(steps) <= 4 and [st["index"] for st in steps] == list(range(len(steps)))
    assert steps[0]["level"] == 2 and steps[0]["phase"] == "ramp"
    recs = records(out)
    for st in steps:  # per-step goodput, recomputed from the step's own records
        mine = [r for r in recs if r["stage"] == st["index"]]
        good = sum(
            r["error"] is None
            and r["ttft"] * 1000 <= thresholds["ttft_ms"]
            and (
                r["completion_tokens"] < 2
                or (r["e2e"] - r["ttft"]) / (r["completion_tokens"] - 1) * 1000 <= thresholds["tpot_ms"]
            )
            for r in mine
        )
        assert (st["requests"], st["good"]) == (len(mine), good), st
        assert st["goodput_per_s"] == pytest.approx(good / 2)
        assert st["passed"] == (bool(mine) and good / len(mine) >= objective)
        assert all(r["level"] == st["level"] for r in mine)
    failing = [st["level"] for st in steps if not st["passed"]]
    passing = [st["level"] for st in steps if st["passed"] and st["level"] < min(failing, default=float("inf"))]
    assert passing, "2 requests/s of 8-token completions should meet slo.yaml's SLO on tiny-random"
    assert g["knee"] == max(passing) and steps[g["knee_step"]]["level"] == g["knee"]
    # every request carried the thresholds as objective headers: the server judged each one, and its TTFT met
    # at least where the client's did (its clock starts after the client's and stops before). Not so for TPOT:
    # a first token that reaches the client late shortens the client's decode time, so no such bound holds
    for slo in ("all", "ttft"):
        assert judged[slo, "true"] + judged[slo, "false"] == len(recs)
    client_ttft_good = sum(r["error"] is None and r["ttft"] * 1000 <= thresholds["ttft_ms"] for r in recs)
    assert judged["ttft", "true"] >= client_ttft_good
    assert g["capped"] == (not failing and g["knee"] == 512)
    assert f"knee: {g['knee']:g} requests/s" in proc.stdout
    assert {c["name"] for c in s["slo_gate"]["checks"]} == {"goodput_knee_min", "reconciliation"}
    assert s["reconciliation"]["ok"] and s["requests"] == len(recs) > 0
    assert [st["level"] for st in s["stages"]] == [st["level"] for st in steps]  # stages are the steps
    assert sorted(s["plots"]) == ["goodput_search.png", "latency_cdf.png", "load_vs_latency.png"]
    png = Image.open(out / "goodput_search.png")
    assert png.size[0] > 200 and float(png.text["sightline:knee"]) == g["knee"]  # the line the plot drew
    drawn = json.loads(png.text["sightline:steps"])
    assert sorted((d["level"], d["passed"]) for d in drawn) == sorted((st["level"], st["passed"]) for st in steps)
    for i in range(len(steps)):
        assert (out / "steps" / f"{i:02d}" / "locust.html").stat().st_size > 0
    # judged again from the folder alone; an unreachable knee fails the gate
    again = loadtest("--gate-only", str(out), "--slo", "goodput_knee_min=100000")
    assert again.returncode == 1 and "FAIL  goodput_knee_min" in again.stdout, again.stdout + again.stderr
