"""Troubleshooting: one panel per row of the TokenizerManager cheat sheet.

The first row follows the troubleshooting table of SGLang's TokenizerManager (symptoms of
lost, slow or stale outputs), the second the reliability machinery (watchdog restarts,
load shedding, deadlines), the third the front-end event loops, the fourth why requests were slow
(why they waited, what caused their decode gaps), the fifth the prefix cache (its hit ratio, why it missed), the
sixth per-request objectives and the OTLP metric pushes:
each panel's title is the question a symptom raises and its description says how to read the answer.
"""

from __future__ import annotations

from dashboards import promql as q
from dashboards.boards.engine import PREFIX_HIT_RATIO
from dashboards.panels import Board, timeseries_panel

GENERATE = 'route=~"/v1/completions|/v1/chat/completions|/generate"'
# The processes that run a TokenizerManager's event loop: `main` with one tokenizer worker,
# `worker-N` with several (there `main` is the hub, which serves no requests but merges /metrics).
FRONT_END = 'role=~"main|worker-.*"'
LOOP_LAG = "sightline_event_loop_lag_seconds"


def event_loop() -> list:
    """Loop lag per front-end process beside that process's CPU: a late loop with a busy core is
    the loop's own work (tokenizing, JSON); a late loop with an idle core is something else
    holding it (a blocking call, GC, a starved host)."""
    role = ("instance", "role")  # one process of one server: instances are not summed
    return [
        timeseries_panel(
            "How late does each front-end event loop run?",
            "Event-loop lag per front-end process of each instance (label role: main, or worker-1, worker-2... with "
            "--tokenizer-worker-num): how much later than asked a 50 ms timer fires. p99 over the samples, and max "
            "(the upper bound of the highest bucket with a sample). Every request that process serves waits that long: "
            "p99 above 100 ms (alert SightlineEventLoopBlocked) shows as ITL and TTFT spikes that the engine panels do "
            "not explain. Right axis: the share of time the loop ran late (sum of lags ÷ time), which counts one long "
            "stall by its length where p99 counts it once. Slow requests carry sightline.event_loop.lag_max_seconds on "
            "their span.",
            "s",
            [
                (q.quantile(0.99, LOOP_LAG, by=role), "p99 {{instance}} {{role}}"),
                (q.quantile(1.0, LOOP_LAG, by=role), "max {{instance}} {{role}}"),
                (q.rate(f"{LOOP_LAG}_sum", by=role), "late share {{instance}} {{role}}"),
            ],
            right={"C": "percentunit"},
        ),
        timeseries_panel(
            "Is the TokenizerManager CPU-bound?",
            "CPU used per front-end process of each instance, in cores (rate of its CPU seconds: 1 = one core "
            "saturated; Python runs one loop on one core). Near 1 with a late loop (left panel): tokenization, JSON "
            "and HTTP saturate that TokenizerManager — run more front-end workers (--tokenizer-worker-num). Far below "
            "1 with a late loop: the loop waits on something blocking (a synchronous call, a GC pause, a starved host) "
            "— take a stack with py-spy dump.",
            "percentunit",
            [(q.rate("sightline_process_cpu_seconds_total", FRONT_END, by=role), "{{instance}} {{role}}")],
        ),
    ]


def why_slow() -> list:
    """Why requests waited (the Scheduler's reason per request per step) and what caused their decode gaps."""
    wait = "sightline_request_wait_seconds"
    return [
        timeseries_panel(
            "Requests waited: why were they not admitted?",
            "Seconds spent in the Scheduler's queue per second, by reason (stacked: the total is the queue time "
            "of every request). kv_capacity: the head of the queue did not fit in the KV pool (add KV: "
            "--max-total-tokens; shorter max_tokens; --admission estimate); queue_order: behind such a head "
            "(admission is strict FCFS); running_limit: --max-running-requests run; step_budget: the step's prefill "
            "budget was spent (--max-prefill-tokens, --max-step-tokens); retracted: steps that retracted requests "
            "admit no one; paused: an operator paused generation; next_step: arrived while a step ran (the floor). "
            "A slow request's breakdown (wait_ms) and its queue spans' wait_reason events say the same for it.",
            "s",
            [(q.rate(f"{wait}_sum", by=("reason",)), "{{reason}}")],
            stack=True,
        ),
        timeseries_panel(
            "Streams stalled: what caused the decode gaps?",
            "Inter-token gaps far above the rank's typical step (over --decode-gap-factor × the median step "
            "interval and --decode-gap-floor), per rate interval by cause. prefill: long prompts prefilled beside "
            "the streams (the decode span's decode_gap event names them: lower --max-step-tokens); retraction: KV "
            "ran out (Engine → Admission and retraction); paused: an operator pause; scheduler_loop: the Scheduler "
            "spent the gap outside steps (a starved host, GC); batch_size: the batch more than doubled; slow_step: "
            "the forward itself. After the Scheduler (the TokenizerManager's count, a decode_gap event on the "
            "server span): detokenizer: the Detokenizer fell behind (Engine → Detokenizer); main_loop: the "
            "TokenizerManager's event loop was held (the row above); engine_restart: streams cut by an engine "
            "failure. GET /debug/timeline shows the steps.",
            "short",
            [(q.rate("sightline_decode_gaps_total", by=("cause",), fn="increase"), "{{cause}}")],
            stack=True,
        ),
    ]


def board() -> Board:
    b = Board(
        "sightline-troubleshooting",
        "Sightline / Troubleshooting",
        "One panel per symptom of the TokenizerManager troubleshooting table: each answers its question.",
    )
    b.row(
        "Symptoms",
        timeseries_panel(
            "Clients time out: do requests reach the server?",
            "HTTP requests handled per second, by route and status. Clients timing out while this stays flat: "
            "the requests never arrive — look at the network, proxy or load balancer in front of sightline.",
            "reqps",
            [(q.rate("sightline_http_requests_total", by=("route", "status")), "{{route}} {{status}}")],
        ),
        timeseries_panel(
            "TokenizerManager got it: did the Scheduler receive it?",
            "Generation requests accepted over HTTP vs requests whose TM → Scheduler hop completed. The second "
            "falling behind the first: the Scheduler is not receiving (wrong socket, crashed or stuck process; "
            "see its heartbeat age in the health panel).",
            "reqps",
            [
                (q.rate("sightline_http_requests_total", GENERATE), "accepted over HTTP"),
                (q.rate("sightline_ipc_hop_latency_seconds_count", 'hop="tm_to_scheduler"'), "reached the Scheduler"),
            ],
        ),
        timeseries_panel(
            "Output is produced: why doesn't the client see it?",
            "Messages dropped because their rid was no longer known where they arrived (by component and what "
            "ended the rid), and aborts by reason. Drops after client_disconnect are expected; unknown_rid or "
            "drops without aborts point at a bug.",
            "cps",
            [
                (
                    q.rate("sightline_stale_messages_dropped_total", by=("component", "reason")),
                    "dropped at {{component}} ({{reason}})",
                ),
                (q.rate("sightline_request_aborts_total", by=("reason",)), "aborted ({{reason}})"),
            ],
        ),
        timeseries_panel(
            "Is memory growing because requests pile up?",
            "Resident memory per process of each instance (left) and requests in flight in the TokenizerManager "
            "(right). RSS rising with in-flight requests: requests pile up — check max_running_requests and admission.",
            "bytes",
            [
                (
                    q.gauge("sightline_process_resident_memory_bytes", by=("instance", "role")),
                    "RSS {{instance}} {{role}}",
                ),
                (q.gauge("sightline_requests_in_flight"), "in flight"),
            ],
            right={"B": "short"},
        ),
        timeseries_panel(
            "Why does /health sometimes answer 503?",
            "/health answers and engine restarts per second (left), the age of each child's last stats "
            "message per instance (right). Unhealthy answers with a growing heartbeat age: a child is stuck or "
            "dead (the watchdog restarts it); with fresh heartbeats and a queue head that fits and ages (right, "
            "only while it fits): the queue admits nothing though tokens may still flow (alert SightlineQueueStuck, "
            "runbook); otherwise the queue is too long — see the Overview.",
            "cps",
            [
                (q.rate("sightline_health_checks_total", by=("healthy",)), "healthy={{healthy}}"),
                (
                    q.gauge("sightline_heartbeat_age_seconds", by=("instance", "role"), agg="max"),
                    "heartbeat age {{instance}} {{role}}",
                ),
                (q.rate("sightline_engine_restarts_total"), "engine restarts"),
                (
                    f"{q.gauge('sightline_queue_head_age_seconds', by=('instance', 'dp_rank'), agg='max')}\n* on "
                    "(instance, dp_rank)\n"
                    f"{q.gauge('sightline_queue_head_fits', by=('instance', 'dp_rank'), agg='max')}",
                    "stuck queue head {{instance}} rank {{dp_rank}}",
                ),
            ],
            right={"B": "s", "D": "s"},
        ),
    )
    b.row(
        "Failures, overload and deadlines",
        timeseries_panel(
            "Did the engine fail and restart?",
            "Engine failures the watchdog saw, by process (role) and cause — exited: the process died (look for "
            "an OOM kill); stalled: no heartbeat for --watchdog-timeout with requests in flight — and the "
            "restarts that followed, counted per rate interval. Each failure ends every request in flight with 503 "
            "(alert SightlineEngineRestarting); how long each recovery took, and which phase of the new "
            "children's start, is on Engine → Startup and recovery (alert SightlineEngineRecoverySlow).",
            "short",
            [
                (
                    q.rate("sightline_engine_failures_total", by=("role", "cause"), fn="increase"),
                    "failure: {{role}} {{cause}}",
                ),
                (q.rate("sightline_engine_restarts_total", fn="increase"), "restarts"),
            ],
        ),
        timeseries_panel(
            "Are requests shed with 429?",
            "Requests refused with 429 + Retry-After by overload protection, by reason — queue_full: "
            "--max-queued-requests requests already wait for their first token; tokens_full: prompt + max_tokens "
            "in flight reached --max-inflight-tokens. Now and then is the protection working; all the time is "
            "too little capacity (alert SightlineLoadShedding).",
            "reqps",
            [(q.rate("sightline_requests_shed_total", by=("reason",)), "{{reason}}")],
        ),
        timeseries_panel(
            "How do failed requests end: 429, 499, 503 or 504?",
            "Generation requests that did not end with 200, per second by outcome and HTTP status. rejected "
            "(4xx): invalid request; shed (429): overload; client_disconnect (499): the client went away; error "
            "(500): the engine failed the request; engine_failure, shutdown, unavailable (503): the engine died, "
            "the server stopped, or the engine was not ready; timeout (504): a deadline passed "
            "(--request-timeout, x-request-timeout, --max-queue-time). 5xx count against the availability SLO. "
            "Tail sampling exported the trace of each one but the rejected (sightline_tail_sampling_traces_total).",
            "reqps",
            [(q.rate("sightline_requests_total", 'status!="200"', by=("outcome", "status")), "{{outcome}} {{status}}")],
            stack=True,
        ),
        timeseries_panel(
            "Do requests time out because they wait?",
            "Requests aborted by a deadline per second (504, left) next to p99 queue time and p99 time to first "
            "token (right). Timeouts rising with queue time: requests wait too long for admission — add "
            "capacity or shed earlier (--max-queued-requests, --max-queue-time); with short queues: generation "
            "itself is slower than the deadline (--request-timeout, clients' x-request-timeout, max_tokens).",
            "reqps",
            [
                (q.rate("sightline_request_aborts_total", 'reason="timeout"'), "timeouts (504)"),
                (q.quantile(0.99, "sightline_request_queue_time_seconds"), "queue time p99"),
                (q.quantile(0.99, "sightline_time_to_first_token_seconds"), "TTFT p99"),
            ],
            right={"B": "s", "C": "s"},
        ),
    )
    b.row("Is the TokenizerManager loop blocked?", *event_loop())
    b.row("Why was it slow?", *why_slow())
    b.row(
        "Prefix cache",
        timeseries_panel(
            "TTFT jumped: did the prefix-cache hit ratio drop?",
            "TTFT p50 and p99 (left) next to the prefix-cache hit ratio (right: prompt tokens reused ÷ prompt "
            "tokens admitted). TTFT up as the ratio falls: requests prefill more of their prompts — the shared "
            "prefix changed (a new system prompt or chat template), traffic moved to prompts that share less, the "
            "cache was flushed, or it is evicted before reuse (Engine → Prefix cache size and evictions). TTFT up "
            "with a steady ratio: the cause is elsewhere — queue time, longer prompts (Request latency "
            "breakdown).",
            "s",
            [
                (q.quantile(0.5, "sightline_time_to_first_token_seconds"), "TTFT p50"),
                (q.quantile(0.99, "sightline_time_to_first_token_seconds"), "TTFT p99"),
                (PREFIX_HIT_RATIO, "prefix-cache hit ratio"),
            ],
            right={"C": "percentunit"},
        ),
        timeseries_panel(
            "Why did the prefix cache miss?",
            "Admitted requests whose prompt the prefix cache matched only in part, per rate interval by why it "
            "matched no more (stacked). evicted: the rest had been cached and was evicted to make room (or "
            "flushed): more KV (--max-total-tokens) keeps it; never_seen: no request of that namespace had it (new "
            "prompts; a shared system prompt that is not byte-identical, or another namespace's); too_short: the "
            "rest is under one 16-token block. A request's first prefill span says where its match ended "
            "(sightline.prefix_cache.*).",
            "short",
            [(q.rate("sightline_prefix_cache_misses_total", by=("reason",), fn="increase"), "{{reason}}")],
            stack=True,
        ),
    )
    b.row("Objectives and OTLP pushes", *objectives_and_exports())
    return b


def objectives_and_exports() -> list:
    """Who misses their latency objectives (and which), and whether the OTLP metric pushes arrive."""
    return [
        timeseries_panel(
            "Which tenants miss their latency objectives, and which?",
            "Requests per second that missed an objective they carried, by tenant and objective (ttft, tpot, e2e; "
            "sightline_request_slo_total met=false). One tenant: its own objectives are tighter than the server "
            "gives (its keys-file slo_*_ms, or the headers its clients send) or its requests are larger; every "
            "tenant: the server is short (SLOs → Server-side goodput; Why was it slow?). Each missed request's "
            "trace is kept (tail sampling reason slo) and names what it missed (sightline.slo.missed).",
            "reqps",
            [
                (
                    q.rate("sightline_request_slo_total", 'met="false"', 'slo!="all"', by=("tenant", "slo")),
                    "{{tenant}} {{slo}}",
                )
            ],
            stack=True,
        ),
        timeseries_panel(
            "Are the OTLP metric pushes failing?",
            "OTLP metric exports per second of each front-end process, by result (--otel-metrics-exporter otlp: the "
            "GenAI instruments and, with --otel-metrics-catalogue, every metric). failed: the collector refused the "
            "push or could not be reached — the server log has the SDK's reason; its numbers are missing from the "
            "OTLP backend (not from /metrics). Flat at 0: OTLP metrics are off.",
            "ops",
            [(q.rate("sightline_otlp_metric_exports_total", by=("instance", "result")), "{{instance}} {{result}}")],
        ),
    ]
