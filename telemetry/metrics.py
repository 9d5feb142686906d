"""Every Prometheus metric sightline exports, defined once.

All metrics live in the front end: per-request histograms are observed there from
the timestamps carried in the messages (so they can carry exemplars) through typed
handles (`Metrics.ttft`, ...; `Spec.attr`), and the Scheduler's and Detokenizer's
numbers arrive in their stats messages and are exposed by `EngineCollector` at scrape
time, read straight from an `EngineView` (`Spec.read`).  A new Scheduler gauge is one
field (with a default) in `SchedulerStats`, its value under that name in the `stats()` of
what computes it (`SchedulerCore`, `KVPool`, `StepStats` or `Scheduler`), and one `Spec`
line here.  Names are `sightline_*`, base units, counters end in `_total`; labels are
low-cardinality (`model_name`, `finish_reason`, ...) and the rid is never one.
`docs/metrics.md` is generated from `SPECS` (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, product
from operator import attrgetter
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from protocol.io_struct import (
    GAP_CAUSES,
    GRAMMAR_CACHE_RESULTS,
    GRAMMAR_ERROR_KINDS,
    MISS_REASONS,
    SPECULATIVE_METHODS,
    STEP_PHASES,
    SchedulerStats,
)
from telemetry.buckets import DEFAULT_BUCKETS
from telemetry.outcomes import ABORT_REASONS, FINISH_REASONS, OUTCOMES, REQUEST_FINISH_REASONS, requests_series
from telemetry.stats import EngineView
from telemetry.tail_sampling import DROP_REASONS, KEEP_REASONS


# -- the catalogue -------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: str | None = None  # a DEFAULT_BUCKETS family
    definition: str = ""  # for docs/metrics.md: exactly what is measured, between which stamps
    source: str = "main"  # main | scheduler | detokenizer | all: where the number is produced
    attr: str = ""  # observed in the main process: the `Metrics` attribute that holds it
    read: str = ""  # exposed at scrape time: where its value is in `EngineView` (a dotted path)
    hub: bool = False  # with several tokenizer workers, observed by the hub (else by each worker, merged)


M = ("model_name",)
R = M + ("dp_rank",)  # an engine number: one series per data-parallel Scheduler rank
MR = M + ("route",)  # a generation request's number: one series per route it came in on
SPECS: tuple[Spec, ...] = (
    # per-request latency histograms (observed in the main process, with exemplars), by route: the generation
    # route the request came in on (/v1/completions, /v1/chat/completions, /generate, /v1/responses)
    Spec(
        "sightline_time_to_first_token_seconds",
        "histogram",
        "Time to first token.",
        MR,
        "ttft",
        "HTTP handler entered (`arrival`) → the TokenizerManager received the first output token. Includes "
        "tokenization, queueing, prefill and the pipeline hops: what a client sees minus the network.",
        attr="ttft",
    ),
    Spec(
        "sightline_inter_token_latency_seconds",
        "histogram",
        "Gap between consecutive output tokens of a request.",
        MR,
        "itl",
        "Pooled over all requests: the time between the TokenizerManager receiving token k and token k+1 "
        "of the same request (vLLM's ITL). One observation per token after the first.",
        attr="itl",
    ),
    Spec(
        "sightline_time_per_output_token_seconds",
        "histogram",
        "Per-request time per output token (TPOT).",
        MR,
        "tpot",
        "One observation per request with n ≥ 2 output tokens: (e2e − TTFT) / (n − 1). TPOT is a per-"
        "request mean; ITL is per gap — a request with one long stall has one large ITL and a modest TPOT.",
        attr="tpot",
    ),
    Spec(
        "sightline_e2e_request_latency_seconds",
        "histogram",
        "End-to-end request latency.",
        MR,
        "e2e",
        "`arrival` → the TokenizerManager received the request's final output (finished, aborted or failed).",
        attr="e2e",
    ),
    Spec(
        "sightline_request_queue_time_seconds",
        "histogram",
        "Time in the Scheduler's waiting queue.",
        MR,
        "stage",
        "Every waiting interval summed: Scheduler received the request (`sched_recv`) → first admitted into a "
        "batch (`scheduled`), plus, for each retraction, retracted → admitted again (`waited`).",
        attr="queue_time",
    ),
    Spec(
        "sightline_request_wait_seconds",
        "histogram",
        "Time in the Scheduler's queue, by why the request was not admitted.",
        MR + ("reason",),
        "stage",
        "Per request, one observation per reason it waited for (summed over "
        "its waiting intervals; the reasons sum to sightline_request_queue_time_seconds). reason: kv_capacity (the "
        "head of the queue did not fit in the KV available) | queue_order (behind a head waiting for KV: admission "
        "is strict FCFS) | running_limit (--max-running-requests run) | step_budget (the step's prefill budget was "
        "spent) | retracted (the step retracted requests: it admits no one) | paused (POST /pause_generation mode "
        "in_place) | next_step (arrived while a step ran, admitted by the next) | grammar (its structured output's "
        "grammar was still compiling; admission passes over it).",
        attr="wait_time",
    ),
    Spec(
        "sightline_request_prefill_time_seconds",
        "histogram",
        "Prefill time (all chunks).",
        MR,
        "stage",
        "`scheduled` → first token sampled (`first_token`), in the Scheduler; spans every prefill chunk.",
        attr="prefill_time",
    ),
    Spec(
        "sightline_request_decode_time_seconds",
        "histogram",
        "Decode time.",
        MR,
        "stage",
        "`first_token` → finished in the Scheduler (`finished`).",
        attr="decode_time",
    ),
    Spec(
        "sightline_request_tokenize_time_seconds",
        "histogram",
        "Tokenization (chat template + encode) time.",
        MR,
        "stage",
        "Start → end of the TokenizerManager's tokenize call for the request.",
        attr="tokenize_time",
    ),
    Spec(
        "sightline_request_detokenize_time_seconds",
        "histogram",
        "Detokenizer busy time for a request.",
        MR,
        "stage",
        "Sum over the request's outputs of `detok_done − detok_recv` (the Detokenizer's work on each batch that "
        "carried the request, from its receipt to just before its send).",
        attr="detokenize_time",
    ),
    Spec(
        "sightline_ipc_hop_latency_seconds",
        "histogram",
        "Latency of one ZMQ hop.",
        ("hop",),
        "stage",
        "Receiver's receive stamp − sender's `sent_at`. hop=tm_to_scheduler (per request), "
        "scheduler_to_detokenizer and detokenizer_to_tm (per output message), scheduler_stats (per stats message).",
        attr="ipc_hop",
    ),
    Spec(
        "sightline_request_prompt_tokens",
        "histogram",
        "Prompt length per request, in tokens.",
        MR,
        "tokens",
        attr="prompt_tokens",
    ),
    Spec(
        "sightline_request_generation_tokens",
        "histogram",
        "Output length per request, in tokens.",
        MR,
        "tokens",
        attr="generation_tokens",
    ),
    # embeddings requests (POST /v1/embeddings, /encode, /v1/rerank, /v1/score...): their own families, one series
    # per route and kind
    Spec(
        "sightline_embedding_request_latency_seconds",
        "histogram",
        "Embeddings request latency, by route and kind.",
        M + ("route", "kind"),
        "stage",
        "One observation per embeddings request and kind. route: the path it "
        "came in on (/v1/embeddings, /encode, /v1/rerank, /rerank, /v2/rerank, /v1/score, /score: a rerank or "
        "score request embeds every text of its body as one embeddings request). kind=e2e: `arrival` → the "
        "TokenizerManager received its vectors (or its error); queue: its longest-waiting input's time in the "
        "Scheduler's queue; prefill: the first input admitted (`scheduled`) → the last input pooled (`finished`); "
        "tokenize: the TokenizerManager's tokenization of every input. Its generation counterparts "
        "(sightline_e2e_request_latency_seconds...) never include embeddings requests.",
        attr="embed_latency",
    ),
    Spec(
        "sightline_embedding_request_size",
        "histogram",
        "Embeddings request size, by route and kind.",
        M + ("route", "kind"),
        "tokens",
        "One observation per embeddings request that reached the engine, route "
        "(as in sightline_embedding_request_latency_seconds) and kind. kind=inputs: its "
        "inputs; tokens: their tokens (after truncate_prompt_tokens), all counted in "
        "sightline_prompt_tokens_total too.",
        attr="embed_size",
    ),
    # counters observed in the main process
    Spec(
        "sightline_requests_total",
        "counter",
        "Requests (generation and embeddings) that ended, by finish reason, HTTP status and outcome (exactly one "
        "per request).",
        M + ("finish_reason", "status", "outcome"),
        definition="finish_reason: " + " | ".join(REQUEST_FINISH_REASONS) + " (tool_calls: the model stopped "
        "and its answer parsed as tool calls; counted with outcome stop). status: the HTTP status the request "
        "ended with (200; 400, 408, 413 or 429 for a request refused before the engine; 499 client gone; "
        "500 engine failure; 503 unavailable; 504 timeout). outcome: "
        + " | ".join(OUTCOMES)
        + " (telemetry/outcomes.py): `sum by (outcome)` adds up to the requests that reached a generation route.",
        attr="requests",
    ),
    Spec(
        "sightline_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", M, attr="prompt_tokens_total"
    ),
    Spec(
        "sightline_generation_tokens_total",
        "counter",
        "Output tokens of finished requests (as in `usage`).",
        M,
        attr="generation_tokens_total",
    ),
    Spec(
        "sightline_tenant_requests_total",
        "counter",
        "Generation requests that ended, by tenant and outcome.",
        ("tenant", "outcome"),
        definition="tenant: the tenant the request's API key names (the keys file's, at "
        "most --max-tenant-labels of them; any other is `other`; `default` without a keys file). outcome: as in "
        "sightline_requests_total, which `sum without (tenant)` equals exactly.",
        attr="tenant_requests",
    ),
    Spec(
        "sightline_tenant_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests, by tenant.",
        ("tenant",),
        definition="Sums over tenants to sightline_prompt_tokens_total exactly.",
        attr="tenant_prompt_tokens",
    ),
    Spec(
        "sightline_tenant_cached_tokens_total",
        "counter",
        "Of those prompt tokens, the ones reused from the tenant's own prefix-cache namespace, by tenant.",
        ("tenant",),
        definition="The sum of `usage.prompt_tokens_details.cached_tokens` of the tenant's finished "
        "requests. A tenant only ever reuses its own namespace's prefixes (--prefix-cache-sharing tenant).",
        attr="tenant_cached_tokens",
    ),
    Spec(
        "sightline_tenant_generation_tokens_total",
        "counter",
        "Output tokens of finished requests, by tenant.",
        ("tenant",),
        definition="Sums over tenants to sightline_generation_tokens_total exactly.",
        attr="tenant_generation_tokens",
    ),
    Spec(
        "sightline_tenant_cpu_seconds_total",
        "counter",
        "Engine CPU time of finished requests, by tenant.",
        ("tenant",),
        definition="Each engine step's CPU time (the Scheduler process's, every thread) split between "
        "the requests of its batch in proportion to the tokens it fed each (1 per decode, a prefill chunk's "
        "length), summed over a request's steps and counted when it ends. Time outside steps is not attributed.",
        attr="tenant_cpu",
    ),
    Spec(
        "sightline_request_slo_total",
        "counter",
        "Generation requests with latency objectives, by objective, whether it was met, and tenant.",
        ("slo", "met", "tenant"),
        definition="One per objective a request had (its x-llm-d-slo-ttft-ms, "
        "x-llm-d-slo-tpot-ms or x-sightline-slo-e2e-ms header, else its tenant's slo_*_ms in the keys file; "
        "telemetry/request_slo.py), counted when it ends: slo=ttft | tpot | e2e, met=true when the request "
        "succeeded (finish reason stop or length) within it; a failed, aborted or refused request meets none. "
        "TPOT is not judged for a successful request of fewer than two output tokens. slo=all: once per request "
        "with any objective, met=true when it met every one — server-side goodput is "
        'rate(...{slo="all", met="true"}). tenant: as in sightline_tenant_requests_total.',
        attr="request_slo",
    ),
    Spec(
        "sightline_api_key_reloads_total",
        "counter",
        "Reloads of the API keys file, by result.",
        ("result",),
        definition="result: ok | failed (the file failed its checks: the previous keys stay in force; the log says "
        "why). Counted by every front-end process (each tokenizer worker reloads on its own).",
        attr="key_reloads",
    ),
    Spec(
        "sightline_request_fields_ignored_total",
        "counter",
        "Unknown request-body fields ignored under --allow-unknown-fields, by route and field.",
        ("route", "field"),
        definition="One per unknown field of an accepted request (without --allow-unknown-fields such a request is "
        "refused with 400 unknown_parameter instead). field: the field's name when it is one of the OpenAI or "
        "vLLM fields other servers accept (`serving.frontend.http.routes.openai_requests.FOREIGN_FIELDS`), else "
        "`other`, so clients cannot grow the series without bound; the request span's `sightline.ignored_fields` "
        "names them all.",
        attr="fields_ignored",
    ),
    Spec(
        "sightline_tool_call_parse_failures_total",
        "counter",
        "Chat answers that started like a tool call but did not parse, by tool-call parser.",
        ("parser",),
        definition="One per choice whose model stopped by itself (finish reason stop) after writing text that "
        "starts like a call in the parser's format (a `<tool_call>` block, `[TOOL_CALLS]`, a JSON object) "
        "but is not one (not JSON, no name, arguments not an object, unfinished): the text is returned as "
        "the message's content. parser: --tool-call-parser's choice. With --dump-content the flight "
        "recorder keeps the text (`tool_call_text`).",
        attr="tool_parse_failures",
    ),
    Spec(
        "sightline_responses_store_evictions_total",
        "counter",
        "Stored /v1/responses responses evicted to keep "
        "the store within --responses-store-size (least recently used first).",
        definition="A later request naming "
        "an evicted response in `previous_response_id` gets a 400, GET /v1/responses/{id} a 404. Per front-end "
        "process (each tokenizer worker has its own store).",
        attr="responses_evicted",
    ),
    Spec(
        "sightline_responses_stored",
        "gauge",
        "Responses held in the /v1/responses store (`store: true`).",
        attr="responses_stored",
    ),
    Spec(
        "sightline_request_aborts_total",
        "counter",
        "Requests aborted before the engine finished them, by reason.",
        M + ("reason",),
        definition="reason: " + " | ".join(ABORT_REASONS) + " (operator: POST /pause_generation mode abort).",
        attr="aborts",
    ),
    Spec(
        "sightline_requests_shed_total",
        "counter",
        "Requests refused with 429 because the server was full.",
        M + ("reason",),
        definition="reason: queue_full (--max-queued-requests) | tokens_full "
        "(--max-inflight-tokens) | tenant_concurrency, tenant_tokens (the tenant's max_concurrent_requests or "
        "tokens_per_minute in the keys file).",
        attr="shed",
    ),
    Spec(
        "sightline_engine_failures_total",
        "counter",
        "Engine process failures seen by the watchdog.",
        ("role", "cause"),
        definition="role: scheduler (scheduler_dp0, scheduler_dp1... with several ranks) | "
        "detokenizer. cause: exited | stalled (no heartbeat for "
        "--watchdog-timeout while requests were in flight) | startup_timeout (a restarted child not ready within "
        "--startup-timeout).",
        attr="engine_failures",
        hub=True,
    ),
    Spec(
        "sightline_engine_restarts_total",
        "counter",
        "Times the engine processes were replaced after a failure.",
        attr="engine_restarts",
        hub=True,
    ),
    Spec(
        "sightline_engine_restart_budget_exhausted",
        "gauge",
        "1 once --max-engine-restarts restarts within --engine-restart-window were spent: the engine stays down and "
        "every request gets 503 until the server is restarted from outside; else 0.",
        attr="restart_budget_exhausted",
        hub=True,
    ),
    Spec(
        "sightline_engine_recovery_seconds",
        "histogram",
        "Time from an engine failure to the engine ready again.",
        (),
        "startup",
        "One observation per recovery that succeeded: the supervisor saw the failure (exit, stall "
        "or start timeout) → every replacement child reported Ready; it includes stopping the failed children, "
        "the restart backoff, any failed attempts in between and the new children's whole start "
        "(sightline_startup_phase_seconds says where that went).",
        attr="engine_recovery",
        hub=True,
    ),
    Spec(
        "sightline_startup_phase_seconds",
        "gauge",
        "How long each phase of each process's latest start took.",
        ("role", "phase"),
        definition="role: main (the supervising process, the hub with several workers) | "
        "scheduler (scheduler_dp0... with several ranks) | detokenizer. phase: imports (the process's creation "
        "→ its own code: interpreter, spawn bootstrap, modules) for every role; main: args (keys file, tokenizer, "
        "GGUF conversion, the front end built), spawn (children spawned → every one ready); scheduler: "
        "model_resolve (model directory, "
        "conversion cache, config), native_kernels (the C++ kernels built or loaded, the thread team started), "
        "weight_load (the weights read and packed for the kernels), kv_pool (the KV cache allocated), peak_probe "
        "(the machine's peak measured, unless --no-peak-probe), draft_model (with --speculative draft: the draft "
        "model resolved, checked and built, its kernels, weights and KV pool); "
        "detokenizer: tokenizer_load. A restarted child's phases replace its "
        "previous start's. The phases are also spans: a `startup` root with a `startup.<phase>` child each.",
        source="all",
        read="startup_phases",
    ),
    Spec(
        "sightline_http_requests_total",
        "counter",
        "HTTP requests handled, by route and status.",
        ("route", "method", "status"),
        definition="route: a route template or `unmatched`; method: GET, HEAD, POST, "
        "PUT, PATCH, DELETE, OPTIONS or `other` (every label value comes from a bounded set).",
        attr="http_requests",
    ),
    Spec(
        "sightline_event_loop_lag_seconds",
        "histogram",
        "How late a front-end process's event loop runs a timer.",
        ("role",),
        "stage",
        "Sampled continuously: a task asks to wake every 50 ms and observes how much later than "
        "asked it ran. Everything that process does (HTTP, SSE, tokenizing inline, output dispatch) waits that long; "
        "a high tail means streams stall in the front end, not in the engine. role: the process, as in "
        "sightline_process_cpu_seconds_total: main (one tokenizer worker) or worker-1, worker-2... (each worker's "
        "series stays apart when the hub merges the workers' registries).",
        attr="loop_lag",
    ),
    Spec(
        "sightline_tail_sampling_traces_total",
        "counter",
        "Traces of requests head sampling left out, by what tail sampling decided at the request's end.",
        ("decision", "reason"),
        definition="decision=kept, reason: error | aborted | shed | slo | ttft | tpot (the "
        "request failed; was aborted, timed out or ended by shutdown; was refused with 429; missed one of its own "
        "latency objectives, as counted in sightline_request_slo_total; breached the TTFT or TPOT threshold) — "
        "its trace is exported from every process. decision=dropped, reason: not_selected (none of those) | "
        "buffer_full (evicted undecided past --tail-sampling-buffer-traces). Head-sampled traces are not "
        "counted here.",
        attr="tail_traces",
        hub=True,
    ),
    Spec(
        "sightline_otlp_metric_exports_total",
        "counter",
        "OTLP metric exports of this front-end process (--otel-metrics-exporter otlp), by result.",
        ("result",),
        definition="result: ok | failed (the collector refused the push or could not be reached; the SDK logs "
        "why). One per periodic export and one at shutdown; 0 while OTLP metrics are off.",
        attr="otlp_exports",
    ),
    Spec(
        "sightline_request_dump_records_total",
        "counter",
        "Request records the flight recorder wrote to --dump-requests DIR (one per request that reached a "
        "generation route).",
        attr="request_dump_records",
    ),
    Spec(
        "sightline_request_dump_errors_total",
        "counter",
        "Request records the flight recorder lost; the requests themselves were not affected.",
        ("reason",),
        definition="reason: write_error (the file could not be opened or written: a full disk, the directory "
        "gone or unwritable; logged at most once per 10 s) | queue_full (the writer thread fell behind by more "
        "than 4096 records).",
        attr="request_dump_errors",
    ),
    Spec(
        "sightline_crash_dumps_total",
        "counter",
        "Crash dumps written on an engine failure (--dump-requests DIR or --crash-dump-dir), by result.",
        ("result",),
        definition="result: written | failed (an error while writing it, logged; the restart went on).",
        attr="crash_dumps",
        hub=True,
    ),
    Spec(
        "sightline_http_connections_open",
        "gauge",
        "Open HTTP connections (at most --max-connections).",
        attr="connections_open",
    ),
    Spec(
        "sightline_http_connections_refused_total",
        "counter",
        "Connections answered 503 and closed at accept because --max-connections were open.",
        attr="connections_refused",
    ),
    Spec(
        "sightline_http_stream_stalls_total",
        "counter",
        "Response streams cut off because the client took no data.",
        ("cause",),
        definition="cause: stalled (a send made no progress for --send-stall-timeout) | deadline (an SSE "
        "send still blocked 1 s after its request's deadline). HTTP/2 gets RST_STREAM, HTTP/1.1 a closed "
        "connection; a request still running is aborted as client_disconnect.",
        attr="stream_stalls",
    ),
    Spec(
        "sightline_control_actions_total",
        "counter",
        "Operator control actions, by action and result.",
        ("action", "result"),
        definition="action: pause_abort | pause_in_place | pause_drain (POST "
        "/pause_generation, by mode) | continue (POST /continue_generation) | tracing (POST /control/tracing) | "
        "log_level (POST /control/log_level). result: ok | rejected (an invalid body, or not possible now: 4xx) | "
        "error (an engine rank or a tokenizer worker did not confirm: 5xx). Refused by auth (401, 403), nothing is "
        "counted.",
        attr="control_actions",
    ),
    Spec(
        "sightline_paused",
        "gauge",
        "1 for the pause mode in effect (POST /pause_generation), 0 for the others.",
        ("mode",),
        definition="mode: abort | in_place | drain. All 0 while generation runs; new generation "
        "requests get 503 `paused` while any is 1.",
        attr="paused",
    ),
    Spec("sightline_health_checks_total", "counter", "/health answers, by result.", ("healthy",), attr="health_checks"),
    Spec(
        "sightline_requests_in_flight",
        "gauge",
        "Requests the TokenizerManager holds (rid_to_state size).",
        M,
        attr="in_flight",
    ),
    # from the children's stats messages, exposed at scrape time
    Spec(
        "sightline_stale_messages_dropped_total",
        "counter",
        "Messages dropped because their rid was no longer known where they arrived.",
        ("component", "message_type", "reason"),
        source="all",
        definition="component: tokenizer_manager | detokenizer | scheduler. reason: what ended the rid there "
        "(a finish reason: stop, length, abort, error; an abort reason: client_disconnect, timeout, ...; "
        "worker_gone) or unknown_rid.",
        read="stale_drops",
    ),
    Spec(
        "sightline_undecodable_messages_total",
        "counter",
        "ZMQ frames that were not one of our message types.",
        ("component",),
        source="all",
        read="undecodable",
    ),
    Spec(
        "sightline_message_handling_errors_total",
        "counter",
        "Messages (or one rid's part of a message) whose handling raised; that rid ended with an error, the "
        "process went on.",
        ("component",),
        source="all",
        read="handling_errors",
    ),
    Spec(
        "sightline_num_requests_running",
        "gauge",
        "Requests in the running batch.",
        R,
        source="scheduler",
        read="scheduler.num_running",
    ),
    Spec(
        "sightline_num_requests_waiting",
        "gauge",
        "Requests in the waiting queue.",
        R,
        source="scheduler",
        read="scheduler.num_waiting",
    ),
    Spec(
        "sightline_kv_slots_used",
        "gauge",
        "KV token slots holding keys/values (the prefix cache's included).",
        R,
        source="scheduler",
        read="scheduler.kv_used",
    ),
    Spec(
        "sightline_kv_slots_reserved",
        "gauge",
        "KV token slots committed to running requests: those they hold plus what the admission policy expects them "
        "to still allocate.",
        R,
        definition="Slots in use (sightline_kv_slots_in_use) + the sum over running "
        "requests of their uncomputed tokens + sightline_new_token_ratio × min(output tokens left, "
        "--new-token-clip). With --admission reserve (ratio 1, no clip) it is each request's worst case, never "
        "above capacity; with estimate it may exceed capacity when requests outgrow the estimate (retraction "
        "follows when a decode step finds no slot).",
        source="scheduler",
        read="scheduler.kv_reserved",
    ),
    Spec(
        "sightline_kv_slots_in_use",
        "gauge",
        "KV token slots running requests hold: their own and the cached prefixes they lock.",
        R,
        definition="Capacity − free − evictable cache: unlocked prefix-cache slots count as free, since any "
        "allocation may evict them.",
        source="scheduler",
        read="scheduler.kv_in_use",
    ),
    Spec(
        "sightline_kv_slots_capacity",
        "gauge",
        "KV token slots in the pool.",
        R,
        source="scheduler",
        read="scheduler.kv_total",
    ),
    Spec(
        "sightline_kv_usage_ratio",
        "gauge",
        "Committed KV slots ÷ capacity (sightline_kv_slots_reserved ÷ sightline_kv_slots_capacity): the admission "
        "policy's headroom; near 1 new requests wait.",
        R,
        source="scheduler",
        read="scheduler.kv_usage_ratio",
    ),
    Spec(
        "sightline_kv_in_use_ratio",
        "gauge",
        "KV slots in use ÷ capacity: what running requests hold, evictable cache counted free.",
        R,
        definition="vLLM's kv_cache_usage_perc counterpart, the load signal KV-aware routers (the Gateway API "
        "Inference Extension) read; 1 means the next decode step retracts requests.",
        source="scheduler",
        read="scheduler.kv_in_use_ratio",
    ),
    Spec(
        "sightline_new_token_ratio",
        "gauge",
        "The admission estimate: the share of its remaining (clipped) output a running request is expected to "
        "generate.",
        R,
        definition="Starts at --init-new-token-ratio, decays after every decode step to "
        "--min-new-token-ratio-factor × it, jumps back up after a retraction; 1 with --admission reserve.",
        source="scheduler",
        read="scheduler.new_token_ratio",
    ),
    Spec(
        "sightline_retractions_total",
        "counter",
        "Running requests taken out of the batch because a decode step would not have found KV for all.",
        R,
        definition="Each goes back to the head of the queue and resumes after the tokens it already has; vLLM's "
        "num_preemptions counterpart.",
        source="scheduler",
        read="scheduler.retractions_total",
    ),
    Spec(
        "sightline_retracted_tokens_total",
        "counter",
        "K/V positions the retracted requests had.",
        R,
        definition="Kept in the prefix cache, pinned (evicted last), unless --disable-prefix-cache.",
        source="scheduler",
        read="scheduler.retracted_tokens_total",
    ),
    Spec(
        "sightline_retraction_recomputed_tokens_total",
        "counter",
        "Of the retracted positions, those computed again when their request resumed.",
        R,
        definition="1 − recomputed ÷ retracted is the cache hit rate of resumptions (0 with "
        "--disable-prefix-cache: everything is recomputed).",
        source="scheduler",
        read="scheduler.retraction_recomputed_tokens_total",
    ),
    Spec(
        "sightline_scheduler_admissions_total",
        "counter",
        "Requests admitted from the waiting queue into the running batch.",
        R,
        definition="Counted in the step that admits them; a request resumed after a retraction counts again. Its "
        "rate is the admission rate: 0 while requests wait is a stuck queue when sightline_queue_head_fits is 1.",
        source="scheduler",
        read="scheduler.admissions_total",
    ),
    Spec(
        "sightline_queue_head_age_seconds",
        "gauge",
        "How long the oldest waiting request of the rank has waited in its queue; 0 when none waits.",
        R,
        definition="Since it entered the queue (or re-entered it after a retraction), as of the rank's latest stats "
        "message (after every step, every --heartbeat-interval when idle). A request whose structured-output "
        "grammar still compiles is not counted (admission passes over it).",
        source="scheduler",
        read="scheduler.queue_head_age_seconds",
    ),
    Spec(
        "sightline_queue_head_fits",
        "gauge",
        "1 when the next request to admit has the KV and the batch room it needs now, else 0.",
        R,
        definition="Fewer than --max-running-requests run and the admission policy's committed KV plus the "
        "request's expected need fit the slots available (free or evictable), its cached prefix not counted; 0 "
        "while paused. A queue head that fits and ages is an engine admitting nothing (alert SightlineQueueStuck, "
        "/health after --queue-stuck-timeout).",
        source="scheduler",
        read="scheduler.queue_head_fits",
    ),
    Spec(
        "sightline_kv_events_published_total",
        "counter",
        "KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) sent to the subscribers of "
        "--kv-events-endpoint.",
        R,
        definition="Counted when their batch left on the PUB socket; 0 with the flag off.",
        source="scheduler",
        read="scheduler.kv_events_published_total",
    ),
    Spec(
        "sightline_kv_events_dropped_total",
        "counter",
        "KV-cache events of batches not sent: the publisher's queue was full, or a subscriber reached --kv-events-hwm.",
        R,
        definition="The Scheduler never waits for a subscriber: a batch a slow subscriber "
        "cannot take is not sent to any, and stays in the replay buffer (the last 10,000 batches) under its "
        "sequence number.",
        source="scheduler",
        read="scheduler.kv_events_dropped_total",
    ),
    Spec(
        "sightline_decode_gaps_total",
        "counter",
        "Inter-token gaps far above the rank's typical step, by cause.",
        R + ("cause",),
        definition="A gap is longer than --decode-gap-factor × the median of the rank's last 64 step intervals and "
        "than --decode-gap-floor (defaults 4, 50 ms). cause, from the steps in the gap (the first that applies): "
        "retraction (the request was retracted) | paused (the Scheduler was paused) | prefill (prefill chunks ran "
        "beside it: the decode span's decode_gap event names them) | scheduler_loop (over half the gap outside any "
        "step) | batch_size (over twice the median batch) | slow_step (the forward itself); off with "
        "--step-timeline-steps 0. Downstream of the Scheduler, the TokenizerManager counts a gap between two "
        "outputs it received (longer than the factor × its median gap and the floor) of which over half passed "
        "after the Scheduler sent the output that ended it: detokenizer (most of that before the Detokenizer was "
        "done with it) | main_loop (most of it after: the TokenizerManager's event loop did not read it); and "
        "engine_restart: a "
        "stream cut by an engine failure after its first token (whatever the wait). dp_rank: the rank that ran "
        "the request.",
        source="all",
        read="decode_gaps",
    ),
    Spec(
        "sightline_batch_size",
        "gauge",
        "Requests in the latest engine step.",
        R,
        source="scheduler",
        read="scheduler.batch_size",
    ),
    Spec(
        "sightline_step_time_seconds",
        "gauge",
        "Duration of the latest engine step.",
        R,
        source="scheduler",
        read="scheduler.step_seconds",
    ),
    Spec(
        "sightline_step_time_budget_seconds",
        "gauge",
        "The time budget the latest engine step's prefill was sized against; 0 when none applied.",
        R,
        definition="While requests decode: --step-time-factor × the typical step (the pure-decode step of the batch "
        "the queue is heading to, running plus waiting requests, as predicted from the step costs learned online; "
        "serving/engine/step_budget.py), at most --max-step-ms; 0 when nothing decoded, with the time "
        "budget off, or before the costs are learned.",
        source="scheduler",
        read="scheduler.step_budget_seconds",
    ),
    Spec(
        "sightline_step_prefill_budget_tokens",
        "gauge",
        "Prompt tokens the latest engine step could prefill.",
        R,
        definition="--max-prefill-tokens when nothing decoded; else what --max-step-tokens and the time budget "
        "leave beside the decodes, at least --min-prefill-chunk. A step prefills less when fewer prompt tokens wait.",
        source="scheduler",
        read="scheduler.prefill_budget_tokens",
    ),
    Spec(
        "sightline_engine_flops_total",
        "counter",
        "Floating-point operations the engine's steps asked for, by "
        "phase (counted from the model's shape, not measured).",
        R + ("phase",),
        definition="Per step, from the model's config and the batch's shape (serving/engine/utilisation.py): 2 per "
        "weight per token in every linear layer, the LM head per sampled token, attention's two products over each "
        "token's attended positions. phase: decode | prefill (a mixed step is counted in both). rate() ÷ "
        "sightline_machine_peak_flops is the achieved fraction of peak compute.",
        source="scheduler",
        read="scheduler.work_flops",
    ),
    Spec(
        "sightline_engine_bytes_total",
        "counter",
        "Bytes the engine's steps moved to and from memory, by phase (counted from the model's shape, not measured).",
        R + ("phase",),
        definition="Per step: every weight read once at its stored width (shared between the phases of a mixed "
        "step by their tokens), each request's K/V read over its context and the new tokens' K/V written, each "
        "linear layer's activations read and written. rate() ÷ sightline_machine_peak_bytes_per_second is the "
        "achieved fraction of peak bandwidth.",
        source="scheduler",
        read="scheduler.work_bytes",
    ),
    Spec(
        "sightline_machine_peak_flops",
        "gauge",
        "Peak FLOP/s the engine's threads reached at start (a float32 GEMM).",
        R,
        definition="Measured once after the model loads (startup phase peak_probe): the best of "
        "repeated 512×512 float32 GEMMs on the engine's threads over ~50 ms. 0 with --no-peak-probe.",
        source="scheduler",
        read="scheduler.peak_flops",
    ),
    Spec(
        "sightline_machine_peak_bytes_per_second",
        "gauge",
        "Peak memory bandwidth the engine's threads reached at start (a memory copy).",
        R,
        definition="Measured once after the model loads: the best of repeated copies "
        "of a 64 MiB buffer over ~50 ms, counting each byte read and written. 0 with --no-peak-probe.",
        source="scheduler",
        read="scheduler.peak_bytes_per_second",
    ),
    Spec(
        "sightline_generation_throughput_tokens_per_second",
        "gauge",
        "Tokens sampled per second over the last few seconds.",
        M,
        source="scheduler",
        read="throughput",
    ),
    Spec(
        "sightline_scheduler_steps_total",
        "counter",
        "Engine steps run.",
        R,
        source="scheduler",
        read="scheduler.steps_total",
    ),
    Spec(
        "sightline_scheduler_prefill_tokens_total",
        "counter",
        "Prompt tokens prefilled (chunked prefill activity).",
        R,
        source="scheduler",
        read="scheduler.prefill_tokens_total",
    ),
    Spec(
        "sightline_scheduler_generated_tokens_total",
        "counter",
        "Tokens sampled by the engine.",
        R,
        source="scheduler",
        read="scheduler.generation_tokens_total",
    ),
    Spec(
        "sightline_prefix_cache_queries_tokens_total",
        "counter",
        "Prompt tokens of requests the Scheduler admitted, each looked up in the prefix cache.",
        R,
        definition="Counted at admission (an aborted request's too); hits ÷ queries is the hit ratio, as vLLM's "
        "`prefix_cache_queries` / `prefix_cache_hits`.",
        source="scheduler",
        read="scheduler.prefix_queries_tokens_total",
    ),
    Spec(
        "sightline_prefix_cache_hits_tokens_total",
        "counter",
        "Of those prompt tokens, how many were reused from the prefix cache (no prefill computed).",
        R,
        definition="The sum of `usage.prompt_tokens_details.cached_tokens` over the requests admitted.",
        source="scheduler",
        read="scheduler.prefix_hits_tokens_total",
    ),
    Spec(
        "sightline_prefix_cache_evicted_tokens_total",
        "counter",
        "Cached KV slots evicted (least recently used first) to make room for new K/V.",
        R,
        source="scheduler",
        read="scheduler.prefix_evicted_tokens_total",
    ),
    Spec(
        "sightline_prefix_cache_misses_total",
        "counter",
        "Admitted requests whose prompt the prefix cache matched only in part, by why it matched no more.",
        R + ("reason",),
        definition="Counted at a request's first admission when fewer than its prompt's positions "
        "but the last were cached. reason, from the block (16 tokens) after the match: evicted (a bounded log of the "
        "last 16384 evicted block hashes, per namespace, holds it: cached, then evicted or flushed) | never_seen (not "
        "in the log) | too_short (the rest ends before the next block boundary). The request's first prefill span "
        "says where the match ended (sightline.prefix_cache.*); no response does.",
        source="scheduler",
        read="scheduler.prefix_misses",
    ),
    Spec(
        "sightline_prefix_cache_tokens",
        "gauge",
        "KV slots the prefix cache holds (part of sightline_kv_slots_used; evictable unless a running request "
        "reuses them).",
        R,
        source="scheduler",
        read="scheduler.prefix_cached_tokens",
    ),
    Spec(
        "sightline_prefix_cache_flushes_total",
        "counter",
        "POST /flush_cache calls, by result.",
        M + ("result",),
        definition="result: ok (flushed) | refused (requests were running and force was not given) | error "
        "(the engine did not answer, or the prefix cache is disabled).",
        attr="cache_flushes",
    ),
    Spec(
        "sightline_seconds_since_last_token",
        "gauge",
        "While requests are in flight: seconds since the engine last sampled a token or the oldest in-flight "
        "request arrived, whichever is later; 0 when idle. Grows without bound when the engine is stuck.",
        M,
        source="scheduler",
        read="seconds_since_last_token",
    ),
    Spec(
        "sightline_engine_step_phase_seconds",
        "histogram",
        "Where engine steps spend their time, by phase.",
        R + ("phase",),
        "stage",
        "Per engine step, the duration of each phase: schedule (admission, chunking, "
        "building the batch's request list), forward (KV slot allocation, batch metadata, the model's forward), "
        "sample (logits → tokens, finish checks), grammar (structured outputs: grammar masks filled and added to "
        "the logits, sampled tokens consumed by their matchers; 0 in a step without any), logprobs "
        "(log-probabilities of sampled tokens and of prompt tokens; 0 in a step that computed none), verify "
        "(--speculative: the acceptance rule over the verified drafts' logits; their rows' forward is in forward; 0 "
        "in a step without drafts), output "
        "(outputs built and sent to the Detokenizer). Every "
        "phase is observed once per step, so their means add up to the mean step. Kept as a histogram in the "
        "Scheduler and sent whole in its stats.",
        source="scheduler",
        read="scheduler.step_phases",
    ),
    Spec(
        "sightline_speculative_proposed_tokens_total",
        "counter",
        "Draft tokens speculative decoding proposed, by method.",
        R + ("method",),
        definition="Only with --speculative (method ngram: prompt lookup; draft: a draft model). Counted when the "
        "step that verified them ran; each is accepted or rejected in that step "
        "(sightline_speculative_accepted_tokens_total; rejected = proposed − accepted).",
        source="scheduler",
        read="scheduler.speculative_proposed",
    ),
    Spec(
        "sightline_speculative_accepted_tokens_total",
        "counter",
        "Of the proposed draft tokens, those the target model accepted, by method.",
        R + ("method",),
        definition="Accepted by the acceptance rule (greedy: the target's argmax; sampled: kept with the target's "
        "probability). accepted ÷ proposed is the acceptance rate; each verify step also gives one token of the "
        "target's own (sightline_speculative_step_tokens).",
        source="scheduler",
        read="scheduler.speculative_accepted",
    ),
    Spec(
        "sightline_speculative_acceptance_rate",
        "histogram",
        "Per finished speculated request: its accepted ÷ proposed draft tokens, by method.",
        R + ("method",),
        definition="Observed once when a request that had drafts verified ends (a request never verified, "
        "its lookups having found nothing, is not observed). Buckets 0, 0.1 … 1.",
        source="scheduler",
        read="scheduler.speculative_acceptance",
    ),
    Spec(
        "sightline_speculative_step_tokens",
        "histogram",
        "Tokens a speculated request got from one verify step (accepted draft tokens + 1), by method.",
        R + ("method",),
        definition="One observation per request per step that verified its draft: 1 means every draft token "
        "was rejected (the step gave what a decode step gives), --speculative-num-tokens + 1 that all were kept. "
        "Its mean is the tokens per step speculation reaches where it drafts.",
        source="scheduler",
        read="scheduler.speculative_step_tokens",
    ),
    Spec(
        "sightline_grammar_compile_seconds",
        "histogram",
        "Structured-output grammar compiles, cold (not cached).",
        R,
        "stage",
        "Per grammar compiled (a cache miss), on the Scheduler's compile threads: llguidance's matcher "
        "built from the spec and its first token mask computed (the tokenizer is built once, not counted; a compile "
        "that fails is counted in sightline_grammar_errors_total instead). A request waits for it with wait reason "
        "`grammar`.",
        source="scheduler",
        read="scheduler.grammar_compile_seconds",
    ),
    Spec(
        "sightline_grammar_cache_total",
        "counter",
        "Requests with a structured output, by whether their grammar was compiled already.",
        R + ("result",),
        definition="result: hit (the Scheduler's compiled-grammar cache "
        "held it, or it was compiling for another request) | miss (compiled for it). The cache keeps the 64 "
        "grammars used last, keyed by kind and spec.",
        source="scheduler",
        read="scheduler.grammar_cache",
    ),
    Spec(
        "sightline_grammar_forced_tokens_total",
        "counter",
        "Tokens sampled from a grammar mask that allowed exactly that token.",
        R,
        definition="Counted when the token is consumed; the share of a structured output the grammar alone "
        "decided (a forward pass each, with nothing to choose).",
        source="scheduler",
        read="scheduler.grammar_forced_tokens_total",
    ),
    Spec(
        "sightline_grammar_errors_total",
        "counter",
        "Requests ended with an error by their grammar, by kind.",
        R + ("kind",),
        definition="kind: compile (the spec did not compile in the engine: the front end checks "
        "it first, so this is rare) | dead_end (the mask left no token to draw: min_tokens banned all it allowed, "
        "or the matcher refused a token). Only that request ends; its batch mates go on.",
        source="scheduler",
        read="scheduler.grammar_errors",
    ),
    Spec(
        "sightline_engine_info",
        "gauge",
        "Always 1 while the engine is up; labels say how it computes.",
        R + ("architecture", "dtype", "quantization"),
        definition="architecture: the registered model class served "
        "(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM); dtype: float32 | bfloat16 "
        "(what the weights, activations and KV "
        "cache are computed in); quantization: none | int8 (weight-only int8 in every linear layer).",
        source="scheduler",
        read="engine_info",
    ),
    Spec(
        "sightline_heartbeat_age_seconds",
        "gauge",
        "Seconds since each child's last stats message.",
        ("role",),
        source="all",
        read="heartbeat_age",
    ),
    Spec(
        "sightline_process_resident_memory_bytes",
        "gauge",
        "Resident memory of each sightline process.",
        ("role",),
        source="all",
        read="rss",
    ),
    Spec(
        "sightline_process_cpu_seconds_total",
        "counter",
        "CPU time of each sightline process.",
        ("role",),
        source="all",
        read="cpu",
    ),
    Spec(
        "sightline_worker_failures_total",
        "counter",
        "Tokenizer workers that died and were replaced (several workers only).",
        ("cause",),
        definition="cause: exited | stalled (up but no heartbeat for "
        "--watchdog-timeout: killed). Its streams ended with it (their connections closed); its requests were "
        "aborted in the engine.",
        attr="worker_failures",
        hub=True,
    ),
    Spec(
        "sightline_tokenizer_workers",
        "gauge",
        "Tokenizer workers up (HTTP server + TokenizerManager processes).",
        attr="workers_up",
        hub=True,
    ),
    Spec(
        "sightline_build_info",
        "gauge",
        "Always 1; labels say what runs.",
        M + ("version",),
        attr="build_info",
        hub=True,
    ),
    # one series per server (pod) over every engine rank: what an inference-aware router (the Gateway API
    # Inference Extension's endpoint picker, llm-d) scrapes, with the model-server protocol's semantics
    Spec(
        "sightline_server_num_requests_waiting",
        "gauge",
        "Requests queued in the server, over every engine rank.",
        M,
        definition="The sum of every Scheduler rank's waiting queue (the protocol's TotalQueuedRequests, as "
        "vLLM's `vllm:num_requests_waiting`).",
        source="scheduler",
        read="server_waiting",
    ),
    Spec(
        "sightline_server_num_requests_running",
        "gauge",
        "Requests being served, over every engine rank.",
        M,
        definition="The sum of every Scheduler rank's running batch (the protocol's TotalRunningRequests, as "
        "vLLM's `vllm:num_requests_running`).",
        source="scheduler",
        read="server_running",
    ),
    Spec(
        "sightline_server_kv_cache_usage_perc",
        "gauge",
        "KV cache utilisation over every engine rank, 0-1.",
        M,
        definition="(Σ KV slots used − Σ evictable cached slots) ÷ Σ capacity over the ranks: the slots running "
        "requests hold, their locked cached prefixes included; a cached prefix no request locks counts as free, "
        "as vLLM's `vllm:kv_cache_usage_perc` counts evictable cached blocks (the protocol's "
        "KVCacheUtilization). Not `sightline_kv_usage_ratio` (reserved ÷ capacity, per rank: admission "
        "headroom).",
        source="scheduler",
        read="server_kv_usage",
    ),
)
BY_NAME = {s.name: s for s in SPECS}

# -- series that exist from the start --------------------------------------------------
# A counter whose series appears only at its first event hides that event from increase()
# and rate() (and from alert rules built on them): every counter whose label values are
# known in advance is exported at 0 from the first scrape. The server fills in
# SERVER_LABELS (its model name, engine roles, Scheduler ranks); ZERO_SERIES lists the rest.
# A counter with another label is in ZERO_SERIES or LAZY_SERIES, with why
# (tests/unit/test_counters_from_zero.py checks it).
SERVER_LABELS = ("model_name", "dp_rank", "role")
# FINISH_REASONS and ABORT_REASONS (imported above) come from the table of endings, telemetry.outcomes
PAUSE_MODES = ("abort", "in_place", "drain")
CONTROL_ACTIONS = tuple(f"pause_{m}" for m in PAUSE_MODES) + ("continue", "tracing", "log_level")
COMPONENTS = ("tokenizer_manager", "scheduler", "detokenizer")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # serving.frontend.tool_parsers.PARSERS, checked there


def _each(**values: tuple[str, ...]) -> tuple[dict[str, str], ...]:
    """Every combination of the given label values."""
    return tuple(dict(zip(values, combo)) for combo in product(*values.values()))


ZERO_SERIES: dict[str, tuple[dict[str, str], ...]] = {
    # the (finish_reason, status, outcome) triples requests end with
    "sightline_requests_total": requests_series(),  # one per way a request ends (telemetry.outcomes.ENDINGS)
    "sightline_request_aborts_total": _each(reason=ABORT_REASONS),
    "sightline_requests_shed_total": _each(reason=("queue_full", "tokens_full", "tenant_concurrency", "tenant_tokens")),
    "sightline_api_key_reloads_total": _each(result=("ok", "failed")),
    "sightline_engine_failures_total": _each(cause=("exited", "stalled", "startup_timeout")),
    "sightline_http_stream_stalls_total": _each(cause=("stalled", "deadline")),
    "sightline_health_checks_total": _each(healthy=("true", "false")),
    "sightline_tail_sampling_traces_total": _each(decision=("kept",), reason=KEEP_REASONS)
    + _each(decision=("dropped",), reason=DROP_REASONS),
    # what each component receives about a rid and may drop, by what ended the rid there
    "sightline_stale_messages_dropped_total": _each(
        component=("tokenizer_manager",),
        message_type=("BatchStrOutput",),
        reason=("unknown_rid",) + FINISH_REASONS + ABORT_REASONS,
    )
    + _each(component=("tokenizer_manager",), message_type=("FlushCacheReqOutput",), reason=("unknown_rid",))
    + _each(
        component=("scheduler",),
        message_type=("AbortReq",),
        reason=("unknown_rid",) + FINISH_REASONS + ("worker_gone",),
    )
    + _each(component=("detokenizer",), message_type=("BatchTokenIDOutput",), reason=("unknown_rid",) + FINISH_REASONS),
    "sightline_undecodable_messages_total": _each(component=COMPONENTS),
    "sightline_message_handling_errors_total": _each(component=COMPONENTS),
    "sightline_prefix_cache_flushes_total": _each(result=("ok", "refused", "error")),
    "sightline_worker_failures_total": _each(cause=("exited", "stalled")),
    "sightline_request_dump_errors_total": _each(reason=("write_error", "queue_full")),
    "sightline_otlp_metric_exports_total": _each(result=("ok", "failed")),
    "sightline_crash_dumps_total": _each(result=("written", "failed")),
    "sightline_tool_call_parse_failures_total": _each(parser=TOOL_CALL_PARSERS),
    "sightline_speculative_proposed_tokens_total": _each(method=SPECULATIVE_METHODS),
    "sightline_speculative_accepted_tokens_total": _each(method=SPECULATIVE_METHODS),
    "sightline_decode_gaps_total": _each(cause=GAP_CAUSES),
    "sightline_prefix_cache_misses_total": _each(reason=MISS_REASONS),
    "sightline_grammar_cache_total": _each(result=GRAMMAR_CACHE_RESULTS),
    "sightline_grammar_errors_total": _each(kind=GRAMMAR_ERROR_KINDS),
    "sightline_engine_flops_total": _each(phase=STEP_PHASES),
    "sightline_engine_bytes_total": _each(phase=STEP_PHASES),
    "sightline_control_actions_total": _each(action=CONTROL_ACTIONS, result=("ok", "rejected", "error")),
}
_TENANT_LAZY = (
    "the tenant values come from the keys file: each tenant's series are made at 0 when the keys load "
    "(telemetry.tenant_usage)"
)
LAZY_SERIES: dict[str, str] = {
    **{
        name: _TENANT_LAZY
        for name in (
            "sightline_tenant_requests_total",
            "sightline_tenant_prompt_tokens_total",
            "sightline_tenant_cached_tokens_total",
            "sightline_tenant_generation_tokens_total",
            "sightline_tenant_cpu_seconds_total",
            "sightline_request_slo_total",
        )
    },
    "sightline_http_requests_total": "route x method x status is bounded but large (thousands of combinations, "
    "most of which never happen)",
    "sightline_request_fields_ignored_total": "only under --allow-unknown-fields, and route x field is most of "
    "it never seen",
    "sightline_process_cpu_seconds_total": "measured, not counted: each live process's series is there at every "
    "scrape, and a 0 for one would be false",
}


def zero_series(
    spec: Spec, model_name: str, roles: tuple[str, ...] = (), ranks: tuple[int, ...] = (0,)
) -> list[dict[str, str]]:
    """The label sets `spec` is exported with at 0 from the start (none for a lazy counter)."""
    if spec.kind != "counter" or spec.name in LAZY_SERIES:
        return []
    listed = ZERO_SERIES.get(spec.name, ({},))
    if any(label not in SERVER_LABELS for label in spec.labels) and spec.name not in ZERO_SERIES:
        return []
    filled = {"model_name": (model_name,), "role": roles, "dp_rank": tuple(str(r) for r in ranks)}
    server = _each(**{label: filled[label] for label in spec.labels if label in SERVER_LABELS})
    return [{**s, **values} for s in server for values in listed]


def _name(spec: Spec) -> str:
    # prometheus_client appends _total to counters itself
    return spec.name[: -len("_total")] if spec.kind == "counter" else spec.name


class EngineCollector(Collector):
    """Exposes the engine's numbers at scrape time: each `read` spec's value from the view.

    A `scheduler.*` path is read from each rank's latest stats, one series per rank
    (`dp_rank`); no series before a rank's first stats.  A number is one sample (labelled
    with the model name); a dict is one sample per key (its one label); a list is one
    sample per item, its labels read from the item's fields (the model name from the
    server) and its value from `count`, else `seconds` (1 without either), or, for a histogram, one series per
    `PhaseHistogram`.
    """

    def __init__(self, model_name: str, view: Callable[[], EngineView]) -> None:
        self.model_name = model_name
        self.view = view
        self.specs = [s for s in SPECS if s.read]

    @staticmethod
    def _value(view: EngineView, path: str):
        try:
            return attrgetter(path)(view)
        except AttributeError:  # a child that has not reported yet (its stats are None)
            return 0

    def _labels(self, spec: Spec, item, rank: SchedulerStats | None = None) -> list[str]:
        return [
            self.model_name
            if label == "model_name"
            else str(rank.dp_rank)
            if rank is not None and label == "dp_rank"
            else str(getattr(item, label))
            for label in spec.labels
        ]

    def collect(self):
        view = self.view()
        for spec in self.specs:
            cls = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}.get(spec.kind, GaugeMetricFamily)
            fam = cls(_name(spec), spec.help, labels=list(spec.labels))
            if spec.read.startswith("scheduler."):  # one series per rank (every rank's, zeros until it reports)
                for rank in view.schedulers:
                    self._add(fam, spec, self._value(rank, spec.read[len("scheduler.") :]), rank)
            else:
                self._add(fam, spec, self._value(view, spec.read))
                self._add_zeros(fam, spec)
            yield fam

    def _add_zeros(self, fam, spec: Spec) -> None:
        """The counter's known series that nothing has counted yet, at 0."""
        seen = {tuple(sorted(s.labels.items())) for s in fam.samples}
        for labels in zero_series(spec, self.model_name):
            if tuple(sorted(labels.items())) not in seen:
                fam.add_metric([labels[label] for label in spec.labels], 0)

    def _add(self, fam, spec: Spec, value, rank: SchedulerStats | None = None) -> None:
        if isinstance(value, dict):
            for key, v in sorted(value.items()):
                fam.add_metric([key], v)
        elif spec.kind == "histogram":  # PhaseHistograms
            for h in value or ():
                cumulative = list(accumulate(h.counts))
                buckets = [(repr(float(b)), c) for b, c in zip(h.bounds, cumulative)] + [("+Inf", cumulative[-1])]
                fam.add_metric(self._labels(spec, h, rank), buckets, h.sum)
        elif isinstance(value, (list, tuple)):
            for item in value:
                fam.add_metric(self._labels(spec, item, rank), getattr(item, "count", getattr(item, "seconds", 1)))
        else:
            fam.add_metric(self._labels(spec, None, rank), value or 0)

    def describe(self):
        return []


class Metrics:
    """The main process's metrics, one typed attribute per `Spec.attr` (observed per request,
    per connection, per health check...), plus the engine's numbers read at scrape time."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    wait_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    tokenize_time: Histogram
    detokenize_time: Histogram
    ipc_hop: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    embed_latency: Histogram
    embed_size: Histogram
    loop_lag: Histogram
    requests: Counter
    prompt_tokens_total: Counter
    generation_tokens_total: Counter
    aborts: Counter
    shed: Counter
    tenant_requests: Counter
    tenant_prompt_tokens: Counter
    tenant_cached_tokens: Counter
    tenant_generation_tokens: Counter
    tenant_cpu: Counter
    request_slo: Counter
    otlp_exports: Counter
    key_reloads: Counter
    fields_ignored: Counter
    tool_parse_failures: Counter
    responses_evicted: Counter
    responses_stored: Gauge
    engine_failures: Counter
    engine_restarts: Counter
    http_requests: Counter
    connections_refused: Counter
    stream_stalls: Counter
    health_checks: Counter
    cache_flushes: Counter
    control_actions: Counter
    paused: Gauge
    restart_budget_exhausted: Gauge
    engine_recovery: Histogram
    connections_open: Gauge
    in_flight: Gauge
    build_info: Gauge
    worker_failures: Counter
    workers_up: Gauge
    tail_traces: Counter
    request_dump_records: Counter
    request_dump_errors: Counter
    crash_dumps: Counter

    def __init__(
        self,
        model_name: str,
        bucket_overrides: dict[str, tuple[float, ...]] | None = None,
        version: str = "0",
        hub: bool = False,
        roles: tuple[str, ...] = ("scheduler", "detokenizer"),
    ) -> None:
        """`hub`: only what the hub of several tokenizer workers owns (`Spec.hub`); the workers have the rest.
        `roles`: the engine's processes (one per Scheduler rank, and the Detokenizer)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        buckets = {**DEFAULT_BUCKETS, **(bucket_overrides or {})}
        for spec in SPECS:
            if not spec.attr or hub and not spec.hub:
                continue
            kw = {"registry": self.registry, "labelnames": spec.labels}
            if spec.kind == "histogram":
                metric = Histogram(_name(spec), spec.help, buckets=buckets[spec.buckets], **kw)
            elif spec.kind == "counter":
                metric = Counter(_name(spec), spec.help, **kw)
            else:
                metric = Gauge(_name(spec), spec.help, **kw)
            setattr(self, spec.attr, metric)
        for spec in SPECS:  # counters exist at 0 from the start, so increase() sees their first event
            metric = getattr(self, spec.attr, None) if spec.attr else None
            if metric is not None and spec.labels:
                for labels in zero_series(spec, model_name, roles):
                    metric.labels(**labels)
        if not hub:  # every pause mode's series from the start: 0 while generation runs
            for mode in PAUSE_MODES:
                self.paused.labels(mode).set(0)
        ProcessCollector(registry=self.registry)  # the main process's own CPU, memory, fds
        self.build_info.labels(model_name, version).set(1)

    def histograms(self) -> list[Histogram]:
        """The histograms observed in this process (mirrored by the OTLP catalogue)."""
        return [getattr(self, s.attr) for s in SPECS if s.kind == "histogram" and s.attr and hasattr(self, s.attr)]

    def count_otlp_export(self, result: str) -> None:
        """One OTLP metric export ended: ok | failed (the hub of several workers counts none: each worker
        counts its own)."""
        if hasattr(self, "otlp_exports"):
            self.otlp_exports.labels(result).inc()

    def count_tail(self, decision: str, reason: str) -> None:
        """One trace decided (or evicted undecided) by tail sampling."""
        self.tail_traces.labels(decision, reason).inc()

    def watch(self, view: Callable[[], EngineView] | None, in_flight: Callable[[], int] | None) -> None:
        """Read the engine's numbers (the process that supervises the engine) and the TM's in-flight
        count (each TokenizerManager) at scrape time."""
        if view is not None:
            self.registry.register(EngineCollector(self.model_name, view))
        if in_flight is not None:
            self.in_flight.labels(self.model_name).set_function(in_flight)
