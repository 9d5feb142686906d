"""Every Prometheus metric sightline exports, defined once.

All metrics live in the main process: per-request histograms are observed there from
the timestamps carried in the messages (so they can carry exemplars), and the
Scheduler's and Detokenizer's numbers arrive in their stats messages and are exposed
by `EngineCollector` at scrape time.  Names are `sightline_*`, base units, counters end
in `_total`; labels are low-cardinality (`model_name`, `finish_reason`, ...) and the
rid is never one.  `docs/metrics.md` is generated from `SPECS` (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# -- buckets -----------------------------------------------------------------------
# Fine below 100 ms (SLO thresholds must be bucket boundaries), long enough for minutes.
DEFAULT_BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
             5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0),
    "itl": (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4,
            0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    "e2e": (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0,
            300.0, 600.0, 1200.0, 2400.0),
    "stage": (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
              30.0, 60.0, 120.0, 300.0, 600.0),
    "tokens": tuple(float(2 ** i) for i in range(16)),  # 1 … 32768
}
DEFAULT_BUCKETS["tpot"] = DEFAULT_BUCKETS["itl"]


def parse_bucket_overrides(text: str | None) -> dict[str, tuple[float, ...]]:
    """`--histogram-buckets "ttft=0.05,0.1,0.2;itl=0.01,0.05"` → {family: buckets}."""
    out: dict[str, tuple[float, ...]] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        key, _, values = part.partition("=")
        key = key.strip()
        if key not in DEFAULT_BUCKETS:
            raise ValueError(f"--histogram-buckets: unknown family {key!r} (known: {', '.join(sorted(DEFAULT_BUCKETS))})")
        try:
            buckets = tuple(float(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"--histogram-buckets: {key}: bucket bounds must be numbers") from None
        if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"--histogram-buckets: {key}: bounds must be positive and strictly increasing")
        out[key] = buckets
    return out


# -- the catalogue -------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: str | None = None  # a DEFAULT_BUCKETS family
    definition: str = ""  # for docs/metrics.md: exactly what is measured, between which stamps
    source: str = "main"  # main | scheduler | detokenizer: where the number is produced


M = ("model_name",)
SPECS: tuple[Spec, ...] = (
    # per-request latency histograms (observed in the main process, with exemplars)
    Spec("sightline_time_to_first_token_seconds", "histogram", "Time to first token.", M, "ttft",
         "HTTP handler entered (`arrival`) → the TokenizerManager received the first output token. Includes "
         "tokenization, queueing, prefill and the pipeline hops: what a client sees minus the network."),
    Spec("sightline_inter_token_latency_seconds", "histogram", "Gap between consecutive output tokens of a request.",
         M, "itl", "Pooled over all requests: the time between the TokenizerManager receiving token k and token k+1 "
         "of the same request (vLLM's ITL). One observation per token after the first."),
    Spec("sightline_time_per_output_token_seconds", "histogram", "Per-request time per output token (TPOT).", M,
         "tpot", "One observation per request with n ≥ 2 output tokens: (e2e − TTFT) / (n − 1). TPOT is a per-"
         "request mean; ITL is per gap — a request with one long stall has one large ITL and a modest TPOT."),
    Spec("sightline_e2e_request_latency_seconds", "histogram", "End-to-end request latency.", M, "e2e",
         "`arrival` → the TokenizerManager received the request's final output (finished, aborted or failed)."),
    Spec("sightline_request_queue_time_seconds", "histogram", "Time in the Scheduler's waiting queue.", M, "stage",
         "Scheduler received the request (`sched_recv`) → first admitted into a batch (`scheduled`)."),
    Spec("sightline_request_prefill_time_seconds", "histogram", "Prefill time (all chunks).", M, "stage",
         "`scheduled` → first token sampled (`first_token`), in the Scheduler; spans every prefill chunk."),
    Spec("sightline_request_decode_time_seconds", "histogram", "Decode time.", M, "stage",
         "`first_token` → finished in the Scheduler (`finished`)."),
    Spec("sightline_request_tokenize_time_seconds", "histogram", "Tokenization (chat template + encode) time.", M,
         "stage", "Start → end of the TokenizerManager's tokenize call for the request."),
    Spec("sightline_request_detokenize_time_seconds", "histogram", "Detokenizer busy time for a request.", M, "stage",
         "Sum over the request's outputs of `detok_done − detok_recv` (the Detokenizer's work on each batch that "
         "carried the request)."),
    Spec("sightline_ipc_hop_latency_seconds", "histogram", "Latency of one ZMQ hop.", ("hop",), "stage",
         "Receiver's receive stamp − sender's `sent_at`. hop=tm_to_scheduler (per request), "
         "scheduler_to_detokenizer and detokenizer_to_tm (per output message), scheduler_stats (per stats message)."),
    Spec("sightline_request_prompt_tokens", "histogram", "Prompt length per request, in tokens.", M, "tokens"),
    Spec("sightline_request_generation_tokens", "histogram", "Output length per request, in tokens.", M, "tokens"),
    # counters observed in the main process
    Spec("sightline_requests_total", "counter", "Generation requests that ended, by finish reason and HTTP status.",
         M + ("finish_reason", "status"),
         definition="finish_reason: stop | length | abort | error. status: the HTTP status the request ended with "
         "(200; 400 for a rejected request; 499 client gone; 500 engine failure; 503 unavailable)."),
    Spec("sightline_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", M),
    Spec("sightline_generation_tokens_total", "counter", "Output tokens of finished requests (as in `usage`).", M),
    Spec("sightline_request_aborts_total", "counter", "Requests aborted before the engine finished them, by reason.",
         M + ("reason",), definition="reason: client_disconnect | shutdown | timeout | stop_string ..."),
    Spec("sightline_requests_shed_total", "counter", "Requests refused with 429 because the server was full.",
         M + ("reason",), definition="reason: queue_full (--max-queued-requests) | tokens_full "
         "(--max-inflight-tokens)."),
    Spec("sightline_engine_failures_total", "counter", "Engine process failures seen by the watchdog.",
         ("role", "cause"), definition="role: scheduler | detokenizer. cause: exited | stalled (no heartbeat for "
         "--watchdog-timeout while requests were in flight) | startup_timeout (a restarted child not ready within "
         "--startup-timeout)."),
    Spec("sightline_engine_restarts_total", "counter", "Times the engine processes were replaced after a failure."),
    Spec("sightline_engine_restart_budget_exhausted", "gauge",
         "1 once --max-engine-restarts restarts within --engine-restart-window were spent: the engine stays down and "
         "every request gets 503 until the server is restarted from outside; else 0."),
    Spec("sightline_http_requests_total", "counter", "HTTP requests handled, by route and status.",
         ("route", "method", "status"), definition="route: a route template or `unmatched`; method: GET, HEAD, POST, "
         "PUT, PATCH, DELETE, OPTIONS or `other` (every label value comes from a bounded set)."),
    Spec("sightline_event_loop_lag_seconds", "histogram", "How late the main process's event loop runs a timer.",
         (), "stage", "Sampled continuously: a task asks to wake every 50 ms and observes how much later than asked "
         "it ran. Everything the main process does (HTTP, SSE, tokenizing inline, output dispatch) waits that long; "
         "a high tail means streams stall in the front end, not in the engine."),
    Spec("sightline_http_connections_open", "gauge", "Open HTTP connections (at most --max-connections)."),
    Spec("sightline_http_connections_refused_total", "counter",
         "Connections answered 503 and closed at accept because --max-connections were open."),
    Spec("sightline_http_stream_stalls_total", "counter", "Response streams cut off because the client took no data.",
         ("cause",), definition="cause: stalled (a send made no progress for --send-stall-timeout) | deadline (an SSE "
         "send still blocked 1 s after its request's deadline). HTTP/2 gets RST_STREAM, HTTP/1.1 a closed "
         "connection; a request still running is aborted as client_disconnect."),
    Spec("sightline_health_checks_total", "counter", "/health answers, by result.", ("healthy",)),
    Spec("sightline_requests_in_flight", "gauge", "Requests the TokenizerManager holds (rid_to_state size).", M),
    # from the children's stats messages, exposed at scrape time
    Spec("sightline_stale_messages_dropped_total", "counter",
         "Messages dropped because their rid was no longer known where they arrived.",
         ("component", "message_type", "reason"), source="all",
         definition="component: tokenizer_manager | detokenizer | scheduler. reason: what ended the rid there "
         "(client_disconnect, stop, length, abort, ...) or unknown_rid."),
    Spec("sightline_undecodable_messages_total", "counter", "ZMQ frames that were not one of our message types.",
         ("component",), source="all"),
    Spec("sightline_message_handling_errors_total", "counter",
         "Messages (or one rid's part of a message) whose handling raised; that rid ended with an error, the "
         "process went on.", ("component",), source="all"),
    Spec("sightline_num_requests_running", "gauge", "Requests in the running batch.", M, source="scheduler"),
    Spec("sightline_num_requests_waiting", "gauge", "Requests in the waiting queue.", M, source="scheduler"),
    Spec("sightline_kv_slots_used", "gauge", "KV token slots holding keys/values.", M, source="scheduler"),
    Spec("sightline_kv_slots_reserved", "gauge", "KV token slots promised to running requests.", M,
         source="scheduler"),
    Spec("sightline_kv_slots_capacity", "gauge", "KV token slots in the pool.", M, source="scheduler"),
    Spec("sightline_kv_usage_ratio", "gauge", "Reserved KV slots ÷ total (admission headroom).", M,
         source="scheduler"),
    Spec("sightline_batch_size", "gauge", "Requests in the latest engine step.", M, source="scheduler"),
    Spec("sightline_step_time_seconds", "gauge", "Duration of the latest engine step.", M, source="scheduler"),
    Spec("sightline_generation_throughput_tokens_per_second", "gauge",
         "Tokens sampled per second over the last few seconds.", M, source="scheduler"),
    Spec("sightline_scheduler_steps_total", "counter", "Engine steps run.", M, source="scheduler"),
    Spec("sightline_scheduler_prefill_tokens_total", "counter", "Prompt tokens prefilled (chunked prefill activity).",
         M, source="scheduler"),
    Spec("sightline_scheduler_generated_tokens_total", "counter", "Tokens sampled by the engine.", M,
         source="scheduler"),
    Spec("sightline_seconds_since_last_token", "gauge",
         "While requests are in flight: seconds since the engine last sampled a token or the oldest in-flight "
         "request arrived, whichever is later; 0 when idle. Grows without bound when the engine is stuck.", M,
         source="scheduler"),
    Spec("sightline_heartbeat_age_seconds", "gauge", "Seconds since each child's last stats message.", ("role",),
         source="all"),
    Spec("sightline_process_resident_memory_bytes", "gauge", "Resident memory of each sightline process.",
         ("role",), source="all"),
    Spec("sightline_process_cpu_seconds_total", "counter", "CPU time of each sightline process.", ("role",),
         source="all"),
    Spec("sightline_build_info", "gauge", "Always 1; labels say what runs.", M + ("version",)),
)
BY_NAME = {s.name: s for s in SPECS}


def _name(spec: Spec) -> str:
    # prometheus_client appends _total to counters itself
    return spec.name[: -len("_total")] if spec.kind == "counter" else spec.name


@dataclass
class EngineSnapshot:
    """What the main process knows about the children at scrape time (see EngineCollector)."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_reserved: int = 0
    kv_total: int = 0
    batch_size: int = 0
    step_seconds: float = 0.0
    throughput: float = 0.0
    steps_total: int = 0
    prefill_tokens_total: int = 0
    generated_tokens_total: int = 0
    seconds_since_last_token: float = 0.0
    stale_drops: Iterable[tuple[str, str, str, int]] = ()
    undecodable: dict[str, int] | None = None
    handling_errors: dict[str, int] | None = None
    heartbeat_age: dict[str, float] | None = None
    rss: dict[str, float] | None = None
    cpu: dict[str, float] | None = None


class EngineCollector(Collector):
    """Exposes the children's numbers (from their stats messages) at scrape time."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def _family(self, name: str):
        spec = BY_NAME[name]
        cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
        return cls(_name(spec), spec.help, labels=list(spec.labels))

    def collect(self):
        s = self.snapshot()
        m = [self.model_name]
        scalars = {
            "sightline_num_requests_running": s.running, "sightline_num_requests_waiting": s.waiting,
            "sightline_kv_slots_used": s.kv_used, "sightline_kv_slots_reserved": s.kv_reserved,
            "sightline_kv_slots_capacity": s.kv_total,
            "sightline_kv_usage_ratio": s.kv_reserved / s.kv_total if s.kv_total else 0.0,
            "sightline_batch_size": s.batch_size, "sightline_step_time_seconds": s.step_seconds,
            "sightline_generation_throughput_tokens_per_second": s.throughput,
            "sightline_scheduler_steps_total": s.steps_total,
            "sightline_scheduler_prefill_tokens_total": s.prefill_tokens_total,
            "sightline_scheduler_generated_tokens_total": s.generated_tokens_total,
            "sightline_seconds_since_last_token": s.seconds_since_last_token,
        }
        for name, value in scalars.items():
            fam = self._family(name)
            fam.add_metric(m, value)
            yield fam
        fam = self._family("sightline_stale_messages_dropped_total")
        for component, mtype, reason, n in s.stale_drops:
            fam.add_metric([component, mtype, reason], n)
        yield fam
        for name, values in (("sightline_undecodable_messages_total", s.undecodable),
                             ("sightline_message_handling_errors_total", s.handling_errors),
                             ("sightline_heartbeat_age_seconds", s.heartbeat_age),
                             ("sightline_process_resident_memory_bytes", s.rss),
                             ("sightline_process_cpu_seconds_total", s.cpu)):
            fam = self._family(name)
            for key, value in sorted((values or {}).items()):
                fam.add_metric([key], value)
            yield fam

    def describe(self):
        return []


class Metrics:
    """The main process's registry: histograms and counters observed per request."""

    def __init__(self, model_name: str, bucket_overrides: dict[str, tuple[float, ...]] | None = None,
                 version: str = "0") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        buckets = {**DEFAULT_BUCKETS, **(bucket_overrides or {})}
        self._m: dict[str, object] = {}
        for spec in SPECS:
            if spec.source != "main":
                continue
            kw = {"registry": self.registry, "labelnames": spec.labels}
            if spec.kind == "histogram":
                self._m[spec.name] = Histogram(_name(spec), spec.help, buckets=buckets[spec.buckets], **kw)
            elif spec.kind == "counter":
                self._m[spec.name] = Counter(_name(spec), spec.help, **kw)
            else:
                self._m[spec.name] = Gauge(_name(spec), spec.help, **kw)
        # Event counters exist at 0 from the start, so increase() sees their first event.
        for reason in ("queue_full", "tokens_full"):
            self.get("sightline_requests_shed_total").labels(model_name, reason)
        for reason in ("client_disconnect", "timeout", "shutdown", "engine_failure"):
            self.get("sightline_request_aborts_total").labels(model_name, reason)
        for cause in ("stalled", "deadline"):
            self.get("sightline_http_stream_stalls_total").labels(cause)
        for role in ("scheduler", "detokenizer"):
            for cause in ("exited", "stalled", "startup_timeout"):
                self.get("sightline_engine_failures_total").labels(role, cause)
        ProcessCollector(registry=self.registry)  # the main process's own CPU, memory, fds
        self.get("sightline_build_info").labels(model_name, version).set(1)

    def watch(self, snapshot: Callable[[], EngineSnapshot], in_flight: Callable[[], int]) -> None:
        """Read the children's numbers and the TM's in-flight count at scrape time."""
        self.registry.register(EngineCollector(self.model_name, snapshot))
        self.get("sightline_requests_in_flight").labels(self.model_name).set_function(in_flight)

    def get(self, name: str):
        return self._m[name]
