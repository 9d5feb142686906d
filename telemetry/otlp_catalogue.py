"""The whole Prometheus catalogue over OTLP, per-request histograms as exponential histograms.

Python's Prometheus client cannot expose native histograms, but an OTLP exponential histogram
reaches Prometheus's OTLP receiver as one.  With `--otel-metrics-catalogue` (and an OTLP metrics
exporter) each front-end process pushes, beside the GenAI instruments:

- every histogram it observes itself (the `Metrics` histograms: TTFT, ITL, TPOT, stages, tokens,
  event-loop lag...), recorded a second time as an OpenTelemetry histogram of the same name with
  base-2 exponential buckets (`HistogramMirror`, fed by `RequestTelemetry.observe`): the
  resolution the fixed Prometheus buckets lack;
- everything else its registry holds (counters as cumulative monotonic sums, gauges, the engine's
  histograms with their Prometheus buckets), read from the registry at each export
  (`registry_metrics`), so the numbers are exactly those of `/metrics`.

With several tokenizer workers each worker pushes its own registry and the hub the engine's
numbers it holds.  Names are the Prometheus names (a counter's without `_total`, which the receiver adds back); a
name ending in `_seconds` has unit `s`, `_bytes` `By`.  `CountingExporter` wraps the OTLP exporter:
it appends the registry's metrics to each export and counts each export's result
(`sightline_otlp_metric_exports_total`), with or without the catalogue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Callable, Iterable

from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from telemetry.genai_instruments import SCHEMA_URL

log = logging.getLogger("sightline.genai_metrics")
SCOPE = InstrumentationScope("sightline", schema_url=SCHEMA_URL)
MAX_SCALE = 20  # the SDK's default; 160 buckets hold 3 decades at scale 3 (TTFT's ms to s)


def unit_of(name: str) -> str:
    return "s" if name.endswith("_seconds") else "By" if name.endswith("_bytes") else ""


def exponential_views(names: Iterable[str]) -> list[View]:
    """Views that give the mirrored histograms exponential buckets (the GenAI ones keep theirs)."""
    return [
        View(
            instrument_type=HistogramInstrument,
            instrument_name=n,
            aggregation=ExponentialBucketHistogramAggregation(max_scale=MAX_SCALE),
        )
        for n in names
    ]


class HistogramMirror:
    """OpenTelemetry twins of a registry's histograms, recorded where the Prometheus ones are observed."""

    def __init__(self, meter, histograms: Iterable) -> None:
        self.twins: dict[int, tuple] = {}  # id(prometheus histogram) → (OTel histogram, its label names)
        for h in histograms:
            twin = meter.create_histogram(h._name, unit=unit_of(h._name), description=h._documentation)
            self.twins[id(h)] = (twin, h._labelnames)

    def observe(self, metric, labels: tuple[str, ...], value: float) -> None:
        twin = self.twins.get(id(metric))
        if twin is not None:
            twin[0].record(value, dict(zip(twin[1], labels)))


def _number(name: str, help: str, kind: str, points: list[NumberDataPoint]) -> Metric:
    data = Sum(points, AggregationTemporality.CUMULATIVE, True) if kind == "counter" else Gauge(points)
    return Metric(name, help, unit_of(name), data)


def _histogram(fam, start: int, now: int) -> Metric:
    """A Prometheus histogram family (cumulative `le` buckets) as explicit-bucket OTLP points."""
    series: dict[tuple, dict] = {}
    for s in fam.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        one = series.setdefault(labels, {"le": [], "count": 0, "sum": 0.0})
        if s.name.endswith("_bucket"):
            one["le"].append((float(s.labels["le"]), int(s.value)))
        elif s.name.endswith("_count"):
            one["count"] = int(s.value)
        elif s.name.endswith("_sum"):
            one["sum"] = float(s.value)
    points = []
    for labels, one in series.items():
        les = sorted(one["le"])
        counts = [c - (les[i - 1][1] if i else 0) for i, (_, c) in enumerate(les)]
        points.append(
            HistogramDataPoint(
                dict(labels),
                start,
                now,
                one["count"],
                one["sum"],
                counts,
                [b for b, _ in les if b != float("inf")],
                None,
                None,
            )
        )
    return Metric(fam.name, fam.documentation, unit_of(fam.name), Histogram(points, AggregationTemporality.CUMULATIVE))


def registry_metrics(registry: CollectorRegistry, skip: frozenset[str], start: int) -> list[Metric]:
    """Every family of `registry` but the `skip`ped (mirrored) histograms, as OTLP metrics now (a family
    with no series yet is left out: OTLP has no empty metric)."""
    now = time.time_ns()
    out = []
    for fam in registry.collect():
        if fam.name in skip:
            continue
        if fam.type == "histogram" and fam.samples:
            out.append(_histogram(fam, start, now))
        elif fam.type in ("counter", "gauge"):
            suffix = "_total" if fam.type == "counter" else ""
            points = [
                NumberDataPoint(dict(s.labels), start, now, float(s.value))
                for s in fam.samples
                if s.name == fam.name + suffix
            ]
            if points:
                out.append(_number(fam.name, fam.documentation, fam.type, points))
    return out


def with_metrics(data: MetricsData, resource: Resource, extra: list[Metric]) -> MetricsData:
    """`data` with `extra` added to its `sightline` scope (the OTLP encoder keeps one entry per resource
    and scope: a second one would replace the first)."""
    rms = list(data.resource_metrics)
    if not rms:
        return MetricsData([ResourceMetrics(resource, [ScopeMetrics(SCOPE, extra, SCHEMA_URL)], SCHEMA_URL)])
    first = rms[0]
    scopes = list(first.scope_metrics)
    mine = next((i for i, sm in enumerate(scopes) if sm.scope == SCOPE), None)
    if mine is None:
        scopes.append(ScopeMetrics(SCOPE, extra, SCHEMA_URL))
    else:
        scopes[mine] = ScopeMetrics(SCOPE, list(scopes[mine].metrics) + extra, SCHEMA_URL)
    rms[0] = ResourceMetrics(first.resource, scopes, first.schema_url)
    return MetricsData(rms)


class CountingExporter(MetricExporter):
    """The OTLP exporter, with the registry's metrics appended to each export (`extra`) and each
    export's result counted (`count`)."""

    def __init__(
        self,
        inner: MetricExporter,
        resource: Resource,
        count: Callable[[str], None] | None = None,
        extra: Callable[[], list[Metric]] | None = None,
    ) -> None:
        super().__init__(inner._preferred_temporality, inner._preferred_aggregation)
        self.inner, self.resource, self.count, self.extra = inner, resource, count, extra

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        if self.extra is not None:
            metrics_data = with_metrics(metrics_data, self.resource, self.extra())
        result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        if self.count is not None:
            self.count("ok" if result is MetricExportResult.SUCCESS else "failed")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class CatalogueReader(PeriodicExportingMetricReader):
    """Exports at every interval even while the SDK's own instruments hold nothing (the SDK's reader then
    skips the export; the hub of several workers records no GenAI instrument at all): the catalogue is
    the content."""

    def collect(self, timeout_millis: float = 10_000) -> None:
        if self._collect is None:  # not registered with a provider yet: the SDK's own warning
            super().collect(timeout_millis)
            return
        data = self._collect(self, timeout_millis=timeout_millis)
        self._receive_metrics(data or MetricsData([]), timeout_millis=timeout_millis)


class LoopCall:
    """Runs a registry read on the event loop's thread, where the collectors' state is written (an
    export runs on the SDK's thread); directly once `direct` is set (at shutdown the loop thread waits
    for the last export, so nothing else runs) or without a running loop."""

    def __init__(self, timeout: float = 5.0) -> None:
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.timeout = timeout
        self.direct = False

    def __call__(self, fn: Callable[[], list[Metric]]) -> list[Metric]:
        loop = self.loop
        if self.direct or loop is None or not loop.is_running() or _running(loop):
            return fn()
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                fut.set_exception(exc)

        loop.call_soon_threadsafe(run)
        try:
            return fut.result(self.timeout)
        except TimeoutError:
            log.warning(
                "the event loop did not read the registry within %.0f s: this export has no catalogue", self.timeout
            )
            return []


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
