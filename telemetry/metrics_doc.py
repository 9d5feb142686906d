"""Generate docs/metrics.md from the metric catalogue (`telemetry.metrics.SPECS`).

    .venv/bin/python -m telemetry.metrics_doc          # rewrite docs/metrics.md
    .venv/bin/python -m telemetry.metrics_doc --check  # exit 1 if it drifted (the tests run this)
"""

from __future__ import annotations

import sys
from pathlib import Path

from telemetry.metrics import DEFAULT_BUCKETS, SPECS

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"

INTRO = """# Metrics reference

Generated from `telemetry/metrics.py` by `python -m telemetry.metrics_doc`; a test fails if
this file and the code disagree. Served at `GET /metrics` by the main process
(OpenMetrics with exemplars when the scraper sends `Accept: application/openmetrics-text`,
which Prometheus does with `--enable-feature=exemplar-storage`).

Every per-request histogram is observed in the main process from the monotonic
timestamps the request's messages carry (`protocol/io_struct.py` `Stamps`), and carries an
exemplar `{trace_id="…"}` when the request was sampled for tracing. The Scheduler's and
Detokenizer's numbers arrive in their stats messages (after every engine step, and every
`--heartbeat-interval` when idle) and are read at scrape time, one series per Scheduler
rank (`dp_rank`). The rid is never a label.

With `--tokenizer-worker-num` > 1 each worker observes its own requests and the hub
merges the workers' registries at every scrape (`telemetry/registry_merge.py`): counters
and histograms are summed (exemplars kept), gauges observed in a worker get a `worker`
label, and the metrics marked *hub* below come from the hub alone. One scrape on the
port, whichever worker answers it, is complete.

## Adding a metric
- **Observed in the main process**: one `Spec(..., attr="x")` line in `telemetry/metrics.py`
  and the typed attribute `x: Histogram` (or `Counter`, `Gauge`) on `Metrics`; code observes
  it as `metrics.x` (a unit test checks the two agree).
- **An engine number**: one field in its stats message (`SchedulerStats` or
  `DetokenizerStats`, `protocol/io_struct.py`) and one `Spec(..., read="scheduler.field")`
  line: the `EngineMonitor` keeps each child's latest stats and `EngineCollector` reads the
  path at scrape time. Two files.
- **A counter with labels**: every series whose label values are known in advance is
  exported at 0 from the first scrape, so `increase()` and alert rules see its first
  event. The server fills in `model_name`, `role` and `dp_rank`; list the other labels'
  values in `ZERO_SERIES`, or say in `LAZY_SERIES` why the counter stays lazy (a unit
  test fails on a labelled counter in neither).

## TTFT, ITL, TPOT — plainly
- **TTFT**: HTTP handler entered → the TokenizerManager received the first output token.
- **ITL** (inter-token latency): one observation per gap between two consecutive output
  tokens of a request, pooled over all requests. A stall shows up as one large ITL.
- **TPOT** (time per output token): one observation per request, `(e2e − TTFT) / (n − 1)`
  for a request of n ≥ 2 output tokens: the mean of that request's gaps.
- **e2e**: HTTP handler entered → the TokenizerManager received the final output.
Client-side numbers (`loadtest/`) add the network and the client's own parsing; server TTFT
is always ≤ client TTFT.

## Histogram buckets
Defaults below; override per family with `--histogram-buckets "ttft=0.05,0.1,0.2;itl=0.01,0.05"`.
SLO thresholds must be bucket boundaries (`dashboards/slo.yaml` is checked against them).

| family | bounds (seconds, or tokens) |
|---|---|
"""


def render() -> str:
    out = [INTRO]
    for fam, bounds in DEFAULT_BUCKETS.items():
        out.append(f"| `{fam}` | {', '.join(f'{b:g}' for b in bounds)} |\n")
    out.append("\n## Metrics\n\n| name | type | labels | source | what, exactly |\n|---|---|---|---|---|\n")
    for s in SPECS:
        labels = ", ".join(f"`{x}`" for x in s.labels) or "—"
        what = s.help + (f" {s.definition}" if s.definition else "")
        if s.buckets:
            what += f" Buckets: `{s.buckets}`."
        source = s.source + (" (hub)" if s.hub else "")
        out.append(f"| `{s.name}` | {s.kind} | {labels} | {source} | {what.replace('|', '/')} |\n")
    out.append("\nThe main process (the hub, with several workers) also exports prometheus_client's standard "
               "`process_*` metrics (its own CPU, memory, file descriptors); every process's CPU and memory are "
               "`sightline_process_*{role}`.\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python -m telemetry.metrics_doc", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
