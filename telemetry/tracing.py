"""Tracing helpers, one `Tracing` per process: provider, sampler, exporters, carriers.

* Resource: `service.name=sightline` (or `OTEL_SERVICE_NAME`), `service.instance.id` (one
  per server, shared by its processes), `sightline.process.role`, `process.pid`, and
  `sightline.dp_rank` (a Scheduler rank) or `sightline.worker` (a tokenizer worker) where
  there are several.
* Propagators `tracecontext,baggage` (or `OTEL_PROPAGATORS`); parent-based ratio sampling.
* Exporters from flags, else the standard `OTEL_*` variables, read as the OpenTelemetry
  SDKs read them (docs/tracing.md lists each): `otlp` (http/protobuf or grpc), `console`,
  `none`, several comma-separated; an OTLP endpoint with no exporter chosen means `otlp`;
  `OTEL_SDK_DISABLED=true` turns tracing off unless the flags ask for an export.
* Stage spans are mostly recorded after the fact from the monotonic stamps the messages
  carry (`record`), converted to wall time with one `WallAnchor` per process.
* Every finished span is also turned into a `SpanRecord`: the main process keeps them
  for /debug/requests, children forward them in their stats messages.
An unsampled request carries its context, but no span is built for it anywhere.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import get_global_textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.baggage.propagation import W3CBaggagePropagator

from protocol.io_struct import SpanRecord
from telemetry.clock import WallAnchor, now_ns

log = logging.getLogger("sightline.tracing")
Carrier = dict[str, str]
PRODUCER_KEY = "sightline-producer"  # traceparent of the latest PRODUCER span, for the CONSUMER's link


def is_sampled(carrier: Carrier) -> bool:
    """W3C flags bit 0, read without parsing the whole context."""
    tp = carrier.get("traceparent", "")
    try:
        return len(tp) >= 55 and int(tp[-2:], 16) & 1 == 1
    except ValueError:
        return False


def _env(name: str, env: Mapping[str, str] | None = None) -> str:
    """A variable as the SDKs read it: unset and empty are the same."""
    return (os.environ if env is None else env).get(name, "").strip()


def otlp_endpoint_configured(flag: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether an OTLP endpoint is given: the flag, or either standard variable."""
    return bool(flag or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env) or _env("OTEL_EXPORTER_OTLP_ENDPOINT", env))


def resolve_exporters(flag: str | None, endpoint: str | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters: the flag, else $OTEL_TRACES_EXPORTER, else `otlp` when an OTLP endpoint is
    configured (`endpoint`, the flag's, or the variables), else none.

    The SDKs' default exporter is `otlp`, so a deployment that only sets an endpoint expects spans
    there; with no endpoint at all we export nothing rather than retry a localhost collector that
    is usually not there."""
    chosen = flag or _env("OTEL_TRACES_EXPORTER", env)
    if not chosen:
        chosen = "otlp" if otlp_endpoint_configured(endpoint, env) else "none"
    names = [x.strip().lower() for x in chosen.split(",") if x.strip()]
    bad = [n for n in names if n not in ("otlp", "console", "none")]
    if bad:
        raise ValueError(f"unknown traces exporter {bad[0]!r}: use otlp, console or none")
    return list(dict.fromkeys(n for n in names if n != "none"))


def sdk_disabled(env: Mapping[str, str] | None = None) -> bool:
    """OTEL_SDK_DISABLED=true (any case), as the SDKs read it."""
    return _env("OTEL_SDK_DISABLED", env).lower() == "true"


def tracing_enabled(args, env: Mapping[str, str] | None = None) -> bool:
    """--enable-tracing, unless OTEL_SDK_DISABLED=true; flags that ask for an export
    (--otel-traces-exporter otlp|console, or an --otel-exporter-otlp-endpoint) are explicit and
    win over that variable, as every flag wins over the environment."""
    if not args.enable_tracing:
        return False
    flags_export = resolve_exporters(args.otel_traces_exporter, args.otel_exporter_otlp_endpoint, env={})
    return not sdk_disabled(env) or bool(flags_export)


_ALWAYS = {"always_on": 1.0, "parentbased_always_on": 1.0, "always_off": 0.0, "parentbased_always_off": 0.0}


def resolve_ratio(flag: float | None, env: Mapping[str, str] | None = None) -> float:
    """The trace-id ratio for new traces: the flag, else $OTEL_TRACES_SAMPLER (`[parentbased_]always_on`,
    `[parentbased_]always_off`, `[parentbased_]traceidratio` with $OTEL_TRACES_SAMPLER_ARG), else 1.0.

    Sampling stays parent-based whatever the variable names: a request that arrives sampled is
    traced. A sampler we do not implement or a bad argument falls back to 1.0 with a warning, as
    the SDKs do, rather than refusing to start."""
    if flag is not None:
        return flag
    sampler = _env("OTEL_TRACES_SAMPLER", env).lower()
    if not sampler:
        return 1.0
    if sampler in _ALWAYS:
        return _ALWAYS[sampler]
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        arg = _env("OTEL_TRACES_SAMPLER_ARG", env) or "1.0"
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if 0.0 <= ratio <= 1.0:
            return ratio
        log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio in [0, 1]; sampling every trace", arg)
        return 1.0
    log.warning("OTEL_TRACES_SAMPLER=%r is not supported (use [parentbased_]always_on, always_off or traceidratio); "
                "sampling every trace", sampler)
    return 1.0


def service_name(env: Mapping[str, str] | None = None) -> str:
    """`sightline`, unless OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) names it:
    several servers told apart in one backend."""
    named = _env("OTEL_SERVICE_NAME", env)
    if named:
        return named
    for item in _env("OTEL_RESOURCE_ATTRIBUTES", env).split(","):
        key, _, value = item.partition("=")
        if key.strip() == "service.name" and value.strip():
            return unquote(value.strip())
    return "sightline"


def _otlp_exporter(protocol: str | None, endpoint: str | None):
    protocol = (protocol or _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True) if endpoint else OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"unknown OTLP protocol {protocol!r}: use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    return HTTPExporter(endpoint=endpoint.rstrip("/") + "/v1/traces") if endpoint else HTTPExporter()


def _attr(v):
    return [str(x) for x in v] if isinstance(v, (list, tuple)) else v


class _LinkedOrRatio(Sampler):
    """Root spans: sampled when they link to a sampled span (a batch `forward` over sampled
    requests), else by the trace-id ratio."""

    def __init__(self, ratio: float) -> None:
        self.ratio = TraceIdRatioBased(ratio)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"LinkedOrRatio{{{self.ratio.rate}}}"


class _RecordProcessor(SpanProcessor):
    """Turns every finished span into a SpanRecord and hands it to `sink`."""

    def __init__(self, role: str, sink: Callable[[SpanRecord], None], extra: dict) -> None:
        self.role, self.pid, self.sink, self.extra = role, os.getpid(), sink, extra

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        self.sink(SpanRecord(
            name=span.name, trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}",
            parent_span_id=f"{span.parent.span_id:016x}" if span.parent else None,
            start_ns=span.start_time or 0, end_ns=span.end_time or 0, kind=span.kind.name, role=self.role,
            pid=self.pid, status=span.status.status_code.name,
            attributes={**self.extra, **{k: _attr(v) for k, v in (span.attributes or {}).items()}},
            links=len(span.links),
        ))


class Tracing:
    """The per-process tracer and the helpers every stage uses."""

    def __init__(self, role: str, *, enabled: bool = True, exporters: Sequence[str] = (), ratio: float = 1.0,
                 protocol: str | None = None, endpoint: str | None = None, instance_id: str = "",
                 sink: Callable[[SpanRecord], None] | None = None, forward_limit: int = 20000,
                 where: dict[str, int] | None = None) -> None:
        """`where`: which instance of its role this process is (`sightline.dp_rank`, `sightline.worker`),
        a resource attribute of its spans and an attribute of their records."""
        self.role = role
        self.enabled = enabled
        self.anchor = WallAnchor.take()
        self.forwarded: deque[SpanRecord] = deque(maxlen=forward_limit)
        self.propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]) \
            if "OTEL_PROPAGATORS" not in os.environ else get_global_textmap()
        self.provider: TracerProvider | None = None
        if not enabled:
            self.tracer = trace.NoOpTracer()
            return
        resource = Resource.create({"service.name": service_name(), "service.instance.id": instance_id,
                                    "sightline.process.role": role, "process.pid": os.getpid(), **(where or {})})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(_LinkedOrRatio(ratio)))
        # The SDK reads OTEL_SDK_DISABLED itself; `enabled` already weighed it against the flags.
        self.provider._disabled = False
        self.provider.add_span_processor(_RecordProcessor(role, sink or self.forwarded.append, dict(where or {})))
        for name in exporters:
            exp = ConsoleSpanExporter() if name == "console" else _otlp_exporter(protocol, endpoint)
            self.provider.add_span_processor(BatchSpanProcessor(exp))
        self.tracer = self.provider.get_tracer("sightline")

    @classmethod
    def from_args(cls, role: str, args, instance_id: str, sink=None, where: dict[str, int] | None = None) -> "Tracing":
        """The process's tracer as the flags and the standard OTEL_* variables configure it (flags win)."""
        return cls(role, enabled=tracing_enabled(args),
                   exporters=resolve_exporters(args.otel_traces_exporter, args.otel_exporter_otlp_endpoint),
                   ratio=resolve_ratio(args.otel_sampling_ratio), protocol=args.otel_exporter_otlp_protocol,
                   endpoint=args.otel_exporter_otlp_endpoint, instance_id=instance_id, sink=sink, where=where)

    # -- carriers -------------------------------------------------------------------
    def extract(self, carrier: Carrier | None) -> Context | None:
        """The context a carrier names, or None when it names no sampled span (build nothing)."""
        if not self.enabled or not carrier or not is_sampled(carrier):
            return None
        ctx = self.propagator.extract(carrier)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def extract_headers(self, headers) -> Context | None:
        """An incoming request's context (honoured as the server span's parent)."""
        if not self.enabled or "traceparent" not in headers:
            return None
        return self.propagator.extract({"traceparent": headers["traceparent"],
                                        **({"tracestate": headers["tracestate"]} if "tracestate" in headers else {}),
                                        **({"baggage": headers["baggage"]} if "baggage" in headers else {})})

    def carrier(self, span: Span) -> Carrier:
        out: Carrier = {}
        if span.get_span_context().is_valid:
            self.propagator.inject(out, context=trace.set_span_in_context(span))
        return out

    def link_of(self, carrier: Carrier) -> list[Link]:
        """A link to the PRODUCER span named in the carrier (messaging: consumer links producer)."""
        tp = carrier.get(PRODUCER_KEY)
        if not tp:
            return []
        sc = trace.get_current_span(self.propagator.extract({"traceparent": tp})).get_span_context()
        return [Link(sc)] if sc.is_valid else []

    # -- spans ----------------------------------------------------------------------
    def wall(self, mono_ns: int) -> int:
        return self.anchor.to_wall_ns(mono_ns)

    def start(self, name: str, ctx: Context | None, *, kind: SpanKind = SpanKind.INTERNAL, attributes=None,
              links: Iterable[Link] = (), start_mono: int | None = None) -> Span:
        return self.tracer.start_span(name, context=ctx, kind=kind, attributes=attributes, links=list(links),
                                      start_time=self.wall(start_mono) if start_mono else None)

    def record(self, name: str, ctx: Context | None, start_mono: int, end_mono: int, *,
               kind: SpanKind = SpanKind.INTERNAL, attributes=None, links: Iterable[Link] = (),
               error: str | None = None, error_message: str | None = None) -> Span | None:
        """A span that already happened (both ends known); nothing when ctx is None."""
        if ctx is None:
            return None
        span = self.start(name, ctx, kind=kind, attributes=attributes, links=links, start_mono=start_mono)
        if error:
            set_error(span, error, error_message)
        span.end(end_time=self.wall(max(end_mono, start_mono)))
        return span

    def stale_drop(self, carrier: Carrier | None, component: str, message_type: str, reason: str) -> None:
        """A short span in the dropped message's own trace: the late message, attributed."""
        ctx = self.extract(carrier)
        if ctx is not None:
            t = now_ns()
            self.record("stale_message_dropped", ctx, t, t, attributes={
                "sightline.component": component, "messaging.message.type": message_type,
                "sightline.drop.reason": reason})

    def drain(self) -> list[SpanRecord]:
        out = list(self.forwarded)
        self.forwarded.clear()
        return out

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def set_error(span: Span, error_type: str, message: str | None = None) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message or error_type))


def trace_id_of(span: Span | None) -> str | None:
    """Hex trace id of a sampled span (for exemplars, logs, headers), else None."""
    if span is None or isinstance(span, NonRecordingSpan) or not span.is_recording():
        return None
    return f"{span.get_span_context().trace_id:032x}"


def traceparent_of(span: Span | None) -> str | None:
    if span is None:
        return None
    sc = span.get_span_context()
    if not sc.is_valid:
        return None
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


MESSAGING = {"messaging.system": "zeromq"}


def hop_attributes(destination: str, message_type: str, operation: str, batch: int | None = None) -> dict:
    attrs = {**MESSAGING, "messaging.destination.name": destination, "messaging.operation.type": operation,
             "messaging.message.type": message_type}
    if batch is not None:
        attrs["messaging.batch.message_count"] = batch
    return attrs
