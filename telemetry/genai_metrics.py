"""OpenTelemetry GenAI semantic-convention metrics, pushed over OTLP beside Prometheus's /metrics.

One `GenAIMetrics` per front-end process (the single main process, or each tokenizer worker)
owns an opentelemetry-sdk `MeterProvider` with one `PeriodicExportingMetricReader` per exporter
and records, per request, the instruments of the GenAI conventions (status Development) with
their names, units and advisory bucket boundaries (telemetry/genai_instruments.py: which names,
legacy, latest or both, per --otel-genai-semconv).  `RequestTelemetry.finish` / `.rejected` call
`record`; `shutdown` exports what is left.  With --otel-metrics-catalogue the same provider pushes
the whole Prometheus catalogue too (telemetry/otlp_catalogue.py).

Switching on (flags win over the standard variables, read as telemetry/tracing.py reads them):
the exporters are --otel-metrics-exporter, else $OTEL_METRICS_EXPORTER, else `otlp` when a
*metrics* endpoint is given (--otel-exporter-otlp-metrics-endpoint or
$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT), else none. The shared OTLP endpoint alone (flag or
$OTEL_EXPORTER_OTLP_ENDPOINT, which turns spans on) does not turn metrics on: /metrics already
serves them, and a traces-only collector would refuse every push. `OTEL_SDK_DISABLED=true` turns
them off unless a flag asks for an export, as for spans.
"""

from __future__ import annotations

import logging
import os
from time import time_ns
from typing import Mapping, Sequence

from telemetry.genai_instruments import (
    DURATION,
    INSTRUMENTS,
    OPERATION_INPUT,
    OPERATION_OUTPUT,
    SCHEMA_URL,
    TOKENS,
    TPOT,
    TTFT,
    USAGE_CACHE_READ,
    USAGE_INPUT,
    USAGE_OUTPUT,
    resolve_semconv,
)
from telemetry.tracing import _env, sdk_disabled, service_name

log = logging.getLogger("sightline.genai_metrics")
DEFAULT_INTERVAL_MS = 60000  # the SDKs' OTEL_METRIC_EXPORT_INTERVAL default


_EXPORTERS = ("otlp", "console", "none")


def metrics_endpoint_configured(flag: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether a metrics-specific OTLP endpoint is given: the flag or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT."""
    return bool(flag or _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", env))


def resolve_metrics_exporters(
    flag: str | None, endpoint: str | None = None, env: Mapping[str, str] | None = None
) -> list[str]:
    """The metric exporters: the flag, else $OTEL_METRICS_EXPORTER, else `otlp` when a metrics
    endpoint is configured (`endpoint`, the flag's, or the variable), else none."""
    chosen = flag or _env("OTEL_METRICS_EXPORTER", env)
    if not chosen:
        chosen = "otlp" if metrics_endpoint_configured(endpoint, env) else "none"
    names = [x.strip().lower() for x in chosen.split(",") if x.strip()]
    bad = [n for n in names if n not in _EXPORTERS]
    if bad:
        raise ValueError(f"unknown metrics exporter {bad[0]!r}: use otlp, console or none")
    return list(dict.fromkeys(n for n in names if n != "none"))


def metrics_exporters(args, env: Mapping[str, str] | None = None) -> list[str]:
    """The exporters for this server: none under OTEL_SDK_DISABLED=true unless the flags ask for an export."""
    flag, endpoint = args.otel_metrics_exporter, args.otel_exporter_otlp_metrics_endpoint
    if sdk_disabled(env) and not resolve_metrics_exporters(flag, endpoint, env={}):
        return []
    return resolve_metrics_exporters(flag, endpoint, env)


def resolve_interval(flag: int | None, env: Mapping[str, str] | None = None) -> int:
    """Milliseconds between exports: the flag, else $OTEL_METRIC_EXPORT_INTERVAL, else 60000 (a bad value
    logs a warning and falls back to 60000, as the SDK does)."""
    if flag is not None:
        return flag
    raw = _env("OTEL_METRIC_EXPORT_INTERVAL", env)
    if not raw:
        return DEFAULT_INTERVAL_MS
    try:
        value = int(float(raw))
    except ValueError:
        value = 0
    if value > 0:
        return value
    log.warning(
        "OTEL_METRIC_EXPORT_INTERVAL=%r is not a positive number of milliseconds; using %d", raw, DEFAULT_INTERVAL_MS
    )
    return DEFAULT_INTERVAL_MS


def _otlp_exporter(protocol: str | None, endpoint: str | None, base: str | None):
    """`endpoint`: the full metrics URL (used as is); `base`: the shared base URL (`/v1/metrics` appended
    for http/protobuf); neither: the exporter reads the OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT variables."""
    protocol = (
        protocol
        or _env("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
        or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        url = endpoint or base
        return OTLPMetricExporter(endpoint=url, insecure=True) if url else OTLPMetricExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"unknown OTLP protocol {protocol!r}: use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HTTPExporter

    url = endpoint or (base.rstrip("/") + "/v1/metrics" if base else None)
    return HTTPExporter(endpoint=url) if url else HTTPExporter()


class GenAIMetrics:
    """The GenAI instruments of one front-end process and the provider that exports them (with
    `catalogue`, a `telemetry.metrics.Metrics`: its whole registry too)."""

    def __init__(
        self,
        exporters: Sequence[str],
        model: str,
        *,
        protocol: str | None = None,
        endpoint: str | None = None,
        base_endpoint: str | None = None,
        interval_ms: int = DEFAULT_INTERVAL_MS,
        instance_id: str = "",
        where: dict[str, int] | None = None,
        semconv: str = "legacy",
        catalogue=None,
        count_export=None,
        role: str = "main",
    ) -> None:
        # imported here: ServerArgs validates the flags with this module, in processes that export nothing
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        from telemetry.otlp_catalogue import (
            CatalogueReader,
            CountingExporter,
            HistogramMirror,
            LoopCall,
            exponential_views,
            registry_metrics,
        )
        from telemetry.request_telemetry import PROVIDER

        resource = Resource.create(
            {
                "service.name": service_name(),
                "service.instance.id": instance_id,
                "sightline.process.role": role,
                "process.pid": os.getpid(),
                **(where or {}),
            }
        )
        histograms = catalogue.histograms() if catalogue is not None else []
        self.loop_call, self.mirror = LoopCall(), None
        start, mirrored = time_ns(), frozenset(h._name for h in histograms)

        def registry_now() -> list:  # the catalogue's families but the mirrored, read on the event loop
            return self.loop_call(lambda: registry_metrics(catalogue.registry, mirrored, start))

        extra = registry_now if catalogue is not None else None

        def exporter(name: str):  # the catalogue goes to every exporter; only OTLP pushes are counted
            if name == "console":
                return CountingExporter(ConsoleMetricExporter(), resource, None, extra)
            return CountingExporter(_otlp_exporter(protocol, endpoint, base_endpoint), resource, count_export, extra)

        reader = CatalogueReader if catalogue is not None else PeriodicExportingMetricReader
        readers = [reader(exporter(name), export_interval_millis=interval_ms) for name in exporters]
        self.provider = MeterProvider(
            metric_readers=readers,
            resource=resource,
            shutdown_on_exit=False,
            views=exponential_views(h._name for h in histograms),
        )
        # The SDK reads OTEL_SDK_DISABLED itself; `metrics_exporters` already weighed it against the flags.
        self.provider._disabled = False
        meter = self.provider.get_meter("sightline", schema_url=SCHEMA_URL)
        if catalogue is not None:
            self.mirror = HistogramMirror(meter, histograms)
        self.semconv = semconv
        self.instruments = {}
        for i in INSTRUMENTS:
            if not i.emitted(semconv):
                continue
            if i.kind == "counter":
                self.instruments[i.name] = meter.create_counter(i.name, unit=i.unit, description=i.description)
            else:
                self.instruments[i.name] = meter.create_histogram(
                    i.name, unit=i.unit, description=i.description, explicit_bucket_boundaries_advisory=list(i.buckets)
                )
        self.base = {"gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model, "gen_ai.response.model": model}
        self._closed = False

    @classmethod
    def from_args(
        cls,
        args,
        model: str,
        instance_id: str,
        where: dict[str, int] | None = None,
        env: Mapping[str, str] | None = None,
        metrics=None,
        role: str = "main",
    ) -> "GenAIMetrics | None":
        """The process's GenAI metrics as the flags and the OTEL_* variables configure them; None when off.
        `metrics`: the process's Prometheus metrics (exports counted; the catalogue, when asked for).
        `role` hub: the hub of several tokenizer workers, which pushes only its catalogue (the engine's
        numbers) and serves no request itself."""
        exporters = metrics_exporters(args, env)
        if not exporters:
            return None
        return cls(
            exporters,
            model,
            protocol=args.otel_exporter_otlp_protocol,
            endpoint=args.otel_exporter_otlp_metrics_endpoint,
            base_endpoint=args.otel_exporter_otlp_endpoint,
            interval_ms=resolve_interval(args.otel_metric_export_interval, env),
            instance_id=instance_id,
            where=where,
            semconv=resolve_semconv(args.otel_genai_semconv, env),
            catalogue=metrics if args.otel_metrics_catalogue else None,
            count_export=metrics.count_otlp_export if metrics is not None else None,
            role=role,
        )

    def _add(self, instrument, value: float, attrs: dict) -> None:
        metric = self.instruments.get(instrument.name)
        if metric is None:
            return
        if instrument.kind == "counter":
            metric.add(value, attrs)
        else:
            metric.record(value, attrs)

    def record(
        self,
        operation: str,
        duration: float,
        *,
        ttft: float | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int = 0,
        error_type: str | None = None,
    ) -> None:
        """One request that ended: `error_type` set for a failed, aborted or refused one (then only the
        duration and the usage counters are recorded, as the conventions record TTFT, TPOT and the token
        histograms for successful responses)."""
        attrs = {"gen_ai.operation.name": operation, **self.base}
        known = bool(input_tokens)  # 0 or None: refused before it was tokenized
        usage = {**attrs, "gen_ai.token.modality": "text" if known else "unknown"}
        self._add(USAGE_INPUT, input_tokens or 0, usage)
        self._add(USAGE_OUTPUT, output_tokens or 0, usage)
        self._add(USAGE_CACHE_READ, cached_tokens, usage)
        if error_type:
            self._add(DURATION, max(duration, 0.0), {**attrs, "error.type": error_type})
            return
        self._add(DURATION, max(duration, 0.0), attrs)
        if ttft is not None:
            self._add(TTFT, max(ttft, 0.0), attrs)
            if output_tokens is not None and output_tokens >= 2:
                self._add(TPOT, max(duration - ttft, 0.0) / (output_tokens - 1), attrs)
        if input_tokens is not None:
            self._add(TOKENS, input_tokens, {**attrs, "gen_ai.token.type": "input"})
            self._add(OPERATION_INPUT, input_tokens, attrs)
        if output_tokens is not None:
            self._add(TOKENS, output_tokens, {**attrs, "gen_ai.token.type": "output"})
            self._add(OPERATION_OUTPUT, output_tokens, attrs)

    def shutdown(self, timeout_ms: int = 5000) -> None:
        """Export what was recorded since the last export (a short-lived server's numbers), then stop."""
        if not self._closed:
            self._closed = True
            self.loop_call.direct = True  # the caller's thread (the loop's) waits for this last export
            self.provider.shutdown(timeout_millis=timeout_ms)
