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
- **An engine number**: one field, with a default, in its stats message (`SchedulerStats`
  or `DetokenizerStats`, `protocol/io_struct.py`); its value under the field's name where
  it is computed: the `stats()` dict of `SchedulerCore` (queues, prefix cache), `KVPool`
  (slots), `StepStats` (the latest step) or `Scheduler` (the process's counters), which
  `Scheduler.make_stats` merges into the message (a unit test fails on a field nobody
  fills), or `DetokenizerManager.stats()`; and one `Spec(..., read="scheduler.field")`
  line: the `EngineMonitor` keeps each child's latest stats and `EngineCollector` reads the
  path at scrape time.
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
    out.append(
        "\nThe main process (the hub, with several workers) also exports prometheus_client's standard "
        "`process_*` metrics (its own CPU, memory, file descriptors); every process's CPU and memory are "
        "`sightline_process_*{role}`.\n"
    )
    out.append(_genai_section())
    return "".join(out)


GENAI_INTRO = (
    """
## OpenTelemetry GenAI metrics (OTLP)
Beside `/metrics`, the main process (each tokenizer worker, with several) can push the model-server
instruments of the OpenTelemetry GenAI semantic conventions (status Development) over OTLP
(`telemetry/genai_metrics.py`). They are off unless asked for:

```bash
sightline serve --otel-metrics-exporter otlp --otel-exporter-otlp-metrics-endpoint http://127.0.0.1:4318/v1/metrics
OTEL_METRICS_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 sightline serve   # the same
```

| flag | variable | default |
|---|---|---|
"""
    "| `--otel-metrics-exporter otlp,console,none` | `OTEL_METRICS_EXPORTER` | `otlp` when a metrics "
    "endpoint is set, else `none` |\n"
    "| `--otel-exporter-otlp-metrics-endpoint URL` (full URL) | `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`; else "
    "`--otel-exporter-otlp-endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/metrics` | the SDK's "
    "(`http://localhost:4318/v1/metrics`, grpc `:4317`) |\n"
    "| `--otel-exporter-otlp-protocol http/protobuf\\|grpc` | `OTEL_EXPORTER_OTLP_METRICS_PROTOCOL`, "
    "`OTEL_EXPORTER_OTLP_PROTOCOL` | `http/protobuf` |\n"
    "| `--otel-metric-export-interval MS` | `OTEL_METRIC_EXPORT_INTERVAL` | `60000` |\n"
    "| `--otel-genai-semconv legacy\\|latest\\|both` | `OTEL_SEMCONV_STABILITY_OPT_IN` listing "
    "`gen_ai_latest_experimental` means `latest` | `legacy` |\n"
    """| `--otel-metrics-catalogue` | | off |

A flag wins over a variable. A metrics endpoint alone (the flag or
`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) means `otlp`, as an endpoint does for spans; the shared
OTLP endpoint alone (which turns spans on) does not turn metrics on: `/metrics` already serves
these numbers, and a traces-only backend would refuse every push. `OTEL_SDK_DISABLED=true` turns
them off unless a metrics flag asks for an export. `--no-enable-metrics` (Prometheus) does not
touch them. Points are cumulative (the SDK's default), exported every interval and once more at
shutdown, so a short-lived server's last numbers arrive. The resource is the spans'
(`service.name`, `service.instance.id`, `sightline.process.role=main`, `process.pid`,
`sightline.worker` for a tokenizer worker); the scope is `sightline`.

Every point carries `gen_ai.operation.name` (`chat`, `text_completion`, `generate` for
`/generate`), `gen_ai.provider.name=sightline`, and `gen_ai.request.model` and
`gen_ai.response.model` (the served model name). A failed request's duration carries
`error.type`, the value its span carries: the abort reason (`client_disconnect`, `timeout`,
`shutdown`, `engine_failure`, ...), `engine_error`, or for a request refused before the engine
its API error code (`invalid_json`, ...). `server.address` and `server.port` are not set. The
meter's scope carries the schema URL `https://opentelemetry.io/schemas/1.42.0`.

**Token usage, legacy and latest names.** The conventions define no model-server token
instrument, so token usage goes on the client ones. They moved to
open-telemetry/semantic-conventions-genai: the one histogram `gen_ai.client.token.usage` by
`gen_ai.token.type` (`input`: the prompt tokens, `output`: the completion tokens, as in the
response's `usage`) becomes counters per token category by `gen_ai.token.modality`
(`gen_ai.client.inference.usage.*`: totals and cost; every request, failed and refused ones
included, `text`, or `unknown` with 0 for a request refused before it was tokenized) and
per-operation histograms without modality (`gen_ai.client.inference.operation.*`:
percentiles). `--otel-genai-semconv` picks the names: `legacy` (the default, as the
conventions ask of an instrumentation that emitted the old ones), `latest` (only the new;
also `OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`) or `both`, side by side while
dashboards and alerts move over; the legacy histogram goes once the new names are the default.

**The whole catalogue** (`--otel-metrics-catalogue`, `telemetry/otlp_catalogue.py`): the same
pushes also carry every metric of this page that the process holds, under its Prometheus name
(a counter's without `_total`, which Prometheus's OTLP receiver adds back; unit `s` for
`_seconds`, `By` for `_bytes`): counters as cumulative monotonic sums, gauges, and the
histograms the process observes itself (the per-request latencies and sizes, the event-loop
lag) as **exponential histograms** — recorded at each observation with base-2 buckets (scale up
to 20), so they arrive in Prometheus as native histograms, which its Python client cannot
expose (each such observation costs about five times the Prometheus one: the SDK's exponential
aggregation, tens of µs per observation on a busy 2-core box, ITL once per token; hence off by
default). The engine's histograms (step phases, grammar compiles) keep their Prometheus buckets.
With several tokenizer workers each worker pushes its own registry (its requests; resource
`sightline.worker`) and the hub the engine's numbers it holds (resource
`sightline.process.role=hub`): summed over the resources they are `/metrics`' merged numbers. A
push goes out every interval even before a request. Each worker's pushes are counted in
`sightline_otlp_metric_exports_total{result}` (the hub's are not).

| instrument | kind, unit | bucket boundaries (the conventions') | recorded for | Prometheus counterpart |
|---|---|---|---|---|
"""
)


def _genai_section() -> str:
    from telemetry.genai_metrics import INSTRUMENTS

    rows = [
        f"| `{i.name}` | {i.kind}, `{i.unit}` | {', '.join(f'{b:.10g}' for b in i.buckets) or '—'} | "
        f"{i.recorded} | " + " / ".join(f"`{n.strip()}`" for n in i.prometheus.split("/")) + " |\n"
        for i in INSTRUMENTS
    ]
    return (
        GENAI_INTRO
        + "".join(rows)
        + (
            "\nThe Prometheus histograms observe every request that reached the engine (aborted and failed "
            "ones too) and none refused before it; TTFT, TPOT and the token histograms here count successful "
            "requests only, the duration and the usage counters every request.\n"
        )
    )


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
