"""Tracing helpers, one `Tracing` per process: provider, sampler, exporters, carriers.

* Resource: `service.name=sightline` (or `OTEL_SERVICE_NAME`), `service.instance.id` (one
  per server, shared by its processes), `sightline.process.role`, `process.pid`, and
  `sightline.dp_rank` (a Scheduler rank) or `sightline.worker` (a tokenizer worker) where
  there are several.
* Propagators `tracecontext,baggage` (or `OTEL_PROPAGATORS`); parent-based ratio sampling at
  the head, and tail sampling (`telemetry.tail_sampling`): with it on, a request the head
  did not sample is still recorded in every process (RECORD_ONLY; the carrier says so with
  `TAIL_KEY`) and its end decides whether its trace is exported.
* Exporters from flags, else the standard `OTEL_*` variables, read as the OpenTelemetry
  SDKs read them (docs/tracing.md lists each): `otlp` (http/protobuf or grpc), `console`,
  `none`, several comma-separated; an OTLP endpoint with no exporter chosen means `otlp`;
  `OTEL_SDK_DISABLED=true` turns tracing off unless the flags ask for an export.
* Stage spans are mostly recorded after the fact from the monotonic stamps the messages
  carry (`record`), converted to wall time with one `WallAnchor` per process.
* Every finished span is also turned into a `SpanRecord`: the main process keeps them
  for /debug/requests, children forward them in their stats messages.
With tail sampling off, an unsampled request carries its context, but no span is built for
it anywhere.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagate import get_global_textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from protocol.io_struct import SpanEventRecord, SpanRecord
from protocol.reasons import FinishReason
from telemetry.clock import WallAnchor, now_ns
from telemetry.genai_instruments import SCHEMA_URL
from telemetry.outcomes import error_type_of
from telemetry.tail_sampling import TailSampler

log = logging.getLogger("sightline.tracing")
Carrier = dict[str, str]
PRODUCER_KEY = "sightline-producer"  # traceparent of the latest PRODUCER span, for the CONSUMER's link
TAIL_KEY = "sightline-tail"  # "1": the request is recorded, unsampled, for tail sampling: record its spans too


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
    log.warning(
        "OTEL_TRACES_SAMPLER=%r is not supported (use [parentbased_]always_on, always_off or traceidratio); "
        "sampling every trace",
        sampler,
    )
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
    protocol = (
        protocol or _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True) if endpoint else OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"unknown OTLP protocol {protocol!r}: use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    return HTTPExporter(endpoint=endpoint.rstrip("/") + "/v1/traces") if endpoint else HTTPExporter()


def _attr(v):
    return [str(x) for x in v] if isinstance(v, (list, tuple)) else v


class _Sampler(Sampler):
    """Parent-based, with the tail-sampling cases.

    * A sampled parent: sampled.  An unsampled local parent: recorded only if the parent is
      (a request kept for the tail decision), else dropped.  An unsampled remote parent:
      recorded only with `record_remote_unsampled` (the engine processes, whose carriers
      are gated by `TAIL_KEY`; the front end only with --tail-sampling-overrides-parent).
    * A root: sampled when it links to a sampled span (a batch `forward` over sampled
      requests) or by the trace-id ratio; otherwise recorded only with `record_roots`.

    The ratio can be changed at runtime (`set_ratio`, POST /control/tracing): roots started
    after the change use the new one."""

    def __init__(self, ratio: float, record_roots: bool = False, record_remote_unsampled: bool = False) -> None:
        self.ratio = TraceIdRatioBased(ratio)
        self.record_roots = record_roots
        self.record_remote_unsampled = record_remote_unsampled

    def set_ratio(self, ratio: float) -> None:
        """Replace the head-sampling ratio of new roots (one attribute swap: no lock needed)."""
        self.ratio = TraceIdRatioBased(ratio)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        parent_span = trace.get_current_span(parent_context)
        parent = parent_span.get_span_context()
        if parent.is_valid:
            if parent.trace_flags.sampled:
                decision = Decision.RECORD_AND_SAMPLE
            elif parent.is_remote:
                decision = Decision.RECORD_ONLY if self.record_remote_unsampled else Decision.DROP
            else:
                decision = Decision.RECORD_ONLY if parent_span.is_recording() else Decision.DROP
            return SamplingResult(decision, attributes if decision != Decision.DROP else None, parent.trace_state)
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        result = self.ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if result.decision == Decision.DROP and self.record_roots:
            return SamplingResult(Decision.RECORD_ONLY, attributes)
        return result

    def get_description(self) -> str:
        return f"SightlineSampler{{{self.ratio.rate},tail={self.record_roots}}}"


class _RecordProcessor(SpanProcessor):
    """Turns every finished span into a SpanRecord and hands it to `sink`."""

    def __init__(self, role: str, sink: Callable[[SpanRecord], None], extra: dict) -> None:
        self.role, self.pid, self.sink, self.extra = role, os.getpid(), sink, extra

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        self.sink(
            SpanRecord(
                name=span.name,
                trace_id=f"{ctx.trace_id:032x}",
                span_id=f"{ctx.span_id:016x}",
                parent_span_id=f"{span.parent.span_id:016x}" if span.parent else None,
                start_ns=span.start_time or 0,
                end_ns=span.end_time or 0,
                kind=span.kind.name,
                role=self.role,
                pid=self.pid,
                status=span.status.status_code.name,
                attributes={**self.extra, **{k: _attr(v) for k, v in (span.attributes or {}).items()}},
                links=len(span.links),
                sampled=ctx.trace_flags.sampled,
                link_ids=[f"{lk.context.trace_id:032x}-{lk.context.span_id:016x}" for lk in span.links],
                status_message=span.status.description or "",
                events=[
                    SpanEventRecord(e.name, e.timestamp, {k: _attr(v) for k, v in (e.attributes or {}).items()})
                    for e in span.events
                ],
            )
        )


class Tracing:
    """The per-process tracer and the helpers every stage uses."""

    def __init__(
        self,
        role: str,
        *,
        enabled: bool = True,
        exporters: Sequence[str] = (),
        ratio: float = 1.0,
        protocol: str | None = None,
        endpoint: str | None = None,
        instance_id: str = "",
        sink: Callable[[SpanRecord], None] | None = None,
        forward_limit: int = 20000,
        where: dict[str, int] | None = None,
        tail: bool = False,
        tail_overrides_parent: bool = False,
    ) -> None:
        """`where`: which instance of its role this process is (`sightline.dp_rank`, `sightline.worker`),
        a resource attribute of its spans and an attribute of their records. `tail`: record the
        requests head sampling left out (the front end: every one; the engine processes: those
        whose carrier has `TAIL_KEY`)."""
        self.role = role
        self.enabled = enabled
        self.tail = enabled and tail
        self.exporters, self.protocol, self.endpoint = list(exporters), protocol, endpoint
        self.anchor = WallAnchor.take()
        self.forwarded: deque[SpanRecord] = deque(maxlen=forward_limit)
        self.propagator = (
            CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
            if "OTEL_PROPAGATORS" not in os.environ
            else get_global_textmap()
        )
        self.provider: TracerProvider | None = None
        self.sampler: _Sampler | None = None  # None when tracing is off
        if not enabled:
            self.tracer = trace.NoOpTracer()
            return
        self.base_resource = {"service.name": service_name(), "service.instance.id": instance_id}
        resource = Resource.create(
            {**self.base_resource, "sightline.process.role": role, "process.pid": os.getpid(), **(where or {})}
        )
        front = role == "main"
        sampler = _Sampler(
            ratio,
            record_roots=self.tail and front,
            record_remote_unsampled=self.tail and (tail_overrides_parent or not front),
        )
        self.sampler = sampler
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        # The SDK reads OTEL_SDK_DISABLED itself; `enabled` already weighed it against the flags.
        self.provider._disabled = False
        self.provider.add_span_processor(_RecordProcessor(role, sink or self.forwarded.append, dict(where or {})))
        for name in exporters:
            self.provider.add_span_processor(BatchSpanProcessor(self.new_exporter(name)))
        self.tracer = self.provider.get_tracer("sightline", schema_url=SCHEMA_URL)

    def tail_sampler(self, max_traces: int, count=None) -> TailSampler | None:
        """The front end's tail sampler (None when tail sampling is off): it exports kept traces with
        exporters of its own, configured like this process's."""
        if not self.tail:
            return None
        return TailSampler.exporting(
            [self.new_exporter(n) for n in self.exporters], self.base_resource, max_traces, count
        )

    def new_exporter(self, name: str):
        """A fresh span exporter of the configured kind (`console` or `otlp`)."""
        return ConsoleSpanExporter() if name == "console" else _otlp_exporter(self.protocol, self.endpoint)

    @classmethod
    def from_args(cls, role: str, args, instance_id: str, sink=None, where: dict[str, int] | None = None) -> "Tracing":
        """The process's tracer as the flags and the standard OTEL_* variables configure it (flags win)."""
        return cls(
            role,
            enabled=tracing_enabled(args),
            exporters=resolve_exporters(args.otel_traces_exporter, args.otel_exporter_otlp_endpoint),
            ratio=resolve_ratio(args.otel_sampling_ratio),
            protocol=args.otel_exporter_otlp_protocol,
            endpoint=args.otel_exporter_otlp_endpoint,
            instance_id=instance_id,
            sink=sink,
            where=where,
            tail=args.otel_tail_sampling,
            tail_overrides_parent=args.tail_sampling_overrides_parent,
        )

    # -- carriers -------------------------------------------------------------------
    def extract(self, carrier: Carrier | None) -> Context | None:
        """The context a carrier names, or None when it names neither a sampled span nor one
        recorded for tail sampling (build nothing)."""
        if not self.enabled or not carrier or not (is_sampled(carrier) or (self.tail and carrier.get(TAIL_KEY))):
            return None
        ctx = self.propagator.extract(carrier)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def extract_headers(self, headers) -> Context | None:
        """An incoming request's context (honoured as the server span's parent)."""
        if not self.enabled or "traceparent" not in headers:
            return None
        return self.propagator.extract(
            {
                "traceparent": headers["traceparent"],
                **({"tracestate": headers["tracestate"]} if "tracestate" in headers else {}),
                **({"baggage": headers["baggage"]} if "baggage" in headers else {}),
            }
        )

    def carrier(self, span: Span) -> Carrier:
        out: Carrier = {}
        sc = span.get_span_context()
        if sc.is_valid:
            self.propagator.inject(out, context=trace.set_span_in_context(span))
            if not sc.trace_flags.sampled and span.is_recording():
                out[TAIL_KEY] = "1"
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

    def start(
        self,
        name: str,
        ctx: Context | None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes=None,
        links: Iterable[Link] = (),
        start_mono: int | None = None,
    ) -> Span:
        return self.tracer.start_span(
            name,
            context=ctx,
            kind=kind,
            attributes=attributes,
            links=list(links),
            start_time=self.wall(start_mono) if start_mono else None,
        )

    def record(
        self,
        name: str,
        ctx: Context | None,
        start_mono: int,
        end_mono: int,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes=None,
        links: Iterable[Link] = (),
        error: str | None = None,
        error_message: str | None = None,
        events: Iterable[tuple[str, int, dict]] = (),
    ) -> Span | None:
        """A span that already happened (both ends known), with its (name, monotonic ns, attributes) events;
        nothing when ctx is None."""
        if ctx is None:
            return None
        span = self.start(name, ctx, kind=kind, attributes=attributes, links=links, start_mono=start_mono)
        for event, at, attrs in events:
            span.add_event(event, attrs, timestamp=self.wall(at))
        if error:
            set_error(span, error, error_message)
        span.end(end_time=self.wall(max(end_mono, start_mono)))
        return span

    def stale_drop(self, carrier: Carrier | None, component: str, message_type: str, reason: str) -> None:
        """A short span in the dropped message's own trace: the late message, attributed."""
        ctx = self.extract(carrier)
        if ctx is not None:
            t = now_ns()
            self.record(
                "stale_message_dropped",
                ctx,
                t,
                t,
                attributes={
                    "sightline.component": component,
                    "messaging.message.type": message_type,
                    "sightline.drop.reason": reason,
                },
            )

    def collect_spans(self) -> list[SpanRecord]:
        out = list(self.forwarded)
        self.forwarded.clear()
        return out

    @property
    def sampling_ratio(self) -> float | None:
        """The head-sampling ratio of new roots (None when tracing is off)."""
        return self.sampler.ratio.rate if self.sampler is not None else None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def set_error(span: Span, error_type: str, message: str | None = None) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message or error_type))


def span_error(span: Span, finish_reason: str, abort_reason: str | None, error: str | None) -> None:
    """A request's server span marked as it ended: failed with its error, or aborted for its reason."""
    error_type = error_type_of(finish_reason, abort_reason)
    if error_type is not None:
        set_error(span, error_type, error if finish_reason == FinishReason.ERROR else None)


def trace_id_of(span: Span | None) -> str | None:
    """Hex trace id of a sampled span (for exemplars, logs, headers), else None."""
    if (
        span is None
        or isinstance(span, NonRecordingSpan)
        or not span.is_recording()
        or not span.get_span_context().trace_flags.sampled
    ):
        return None
    return f"{span.get_span_context().trace_id:032x}"


def tail_trace_id_of(span: Span | None) -> str | None:
    """Hex trace id of a span recorded for tail sampling only (recording, not sampled), else None."""
    if span is None or not span.is_recording() or span.get_span_context().trace_flags.sampled:
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
    attrs = {
        **MESSAGING,
        "messaging.destination.name": destination,
        "messaging.operation.type": operation,
        "messaging.message.type": message_type,
    }
    if batch is not None:
        attrs["messaging.batch.message_count"] = batch
    return attrs
