"""Overview: is sightline serving, how fast, how loaded — the first board to open."""

from __future__ import annotations

from dashboards import promql as q
from dashboards.boards.tenants import tenant_panels
from dashboards.panels import Board, annotation, latency_panel, stat_panel, timeseries_panel

REQ = "sightline_requests_total"
ERRORS = 'status=~"5.."'
# Per-engine-rank and per-worker series are kept apart per instance: rank 0 of one replica is
# not rank 0 of another, so summing them by rank alone would merge different servers.
INSTANCE = ("instance",)
RANK, WORKER, ROLE = ("instance", "dp_rank"), ("instance", "worker"), ("instance", "role")
# `sightline_worker_failures_total` exists only with several workers (the hub's); with one
# worker the panel reads 0, not "no data" (0 × the workers-up gauge, which is always there).
WORKER_FAILURES = (
    f"{q.rate('sightline_worker_failures_total', by=INSTANCE, fn='increase')}\n"
    f"or 0 * {q.gauge('sightline_tokenizer_workers', by=INSTANCE)}"
)


CONTROL = "sightline_control_actions_total"
PAUSED = "sightline_paused"


def control_annotations() -> list:
    """Marks on every time series: each operator control action, and the time generation was paused."""
    return [
        annotation(
            "Control actions",
            f"{q.rate(CONTROL, by=('action', 'result'), fn='increase')} > 0",
            "{{action}} ({{result}})",
            "operator control action (POST /pause_generation, "
            "/continue_generation, /control/*); the server logs who and what",
            ("action", "result"),
            "blue",
        ),
        annotation(
            "Generation paused",
            f"{q.gauge(PAUSED, by=('instance', 'mode'), agg='max')} > 0",
            "{{instance}} paused ({{mode}})",
            "generation paused by an operator: new requests get 503 paused (docs/runbook.md, Pause for maintenance)",
            ("instance", "mode"),
            "orange",
        ),
    ]


def pause_panel() -> object:
    return timeseries_panel(
        "Pauses and control actions",
        "1 while generation is paused in that mode (sightline_paused{mode}: abort, in_place, drain; POST "
        "/pause_generation until /continue_generation), and operator control actions per rate interval by action "
        "and result (sightline_control_actions_total). The same show as annotations on every panel. While "
        "paused, /health and new generation requests answer 503 paused. Pauses are per instance (each server "
        "is paused on its own): one series per paused instance; control actions are summed over instances.",
        "short",
        [
            (q.gauge(PAUSED, by=("instance", "mode"), agg="max"), "{{instance}} paused {{mode}}"),
            (q.rate(CONTROL, by=("action", "result"), fn="increase"), "{{action}} {{result}}"),
        ],
        width=24,
    )


CPU = "sightline_process_cpu_seconds_total"
# Output tokens per second, no series while nothing is generated (no division by 0).
OUTPUT_TOKENS = f"({q.rate('sightline_generation_tokens_total')} > 0)"


def cpu_per_token() -> object:
    """CPU seconds each process spends per output token: the cost of a token in core-seconds."""
    return timeseries_panel(
        "CPU seconds per output token",
        "CPU seconds each sightline process used per output token generated (rate of "
        "sightline_process_cpu_seconds_total by role ÷ rate of sightline_generation_tokens_total), and all "
        "processes together. Price a token: core-hour price × CPU seconds per token ÷ 3600 (docs/runbook.md, "
        "Cost per output token; recording rules job_role: and job:sightline_cpu_seconds_per_output_token:rate5m). "
        "Rising at a steady token rate: each token costs more CPU (smaller batches, longer prompts, a front end "
        "doing more per token); no data while nothing is generated.",
        "s",
        [
            (f"{q.rate(CPU, by=('role',))}\n/ on () group_left ()\n{OUTPUT_TOKENS}", "{{role}}"),
            (f"{q.rate(CPU)}\n/\n{OUTPUT_TOKENS}", "all processes"),
        ],
        width=24,
    )


def workers_and_ranks() -> list:
    """One series per Scheduler rank (`--dp-size`, label dp_rank), per tokenizer worker
    (`--tokenizer-worker-num`, label worker) and per process (role), each per instance: an uneven
    spread is a rank or a worker doing more than its share. With one of each, one series."""
    return [
        timeseries_panel(
            "Running and waiting by rank",
            "Requests in each Scheduler rank's running batch and waiting queue (--dp-size ranks, label "
            "dp_rank), per instance. One rank's queue growing while the others run light: the "
            "dispatcher sends it more than its share, or that rank is slower.",
            "short",
            [
                (q.gauge("sightline_num_requests_running", by=RANK), "running {{instance}} rank {{dp_rank}}"),
                (q.gauge("sightline_num_requests_waiting", by=RANK), "waiting {{instance}} rank {{dp_rank}}"),
            ],
            width=8,
        ),
        timeseries_panel(
            "KV usage ratio by rank",
            "KV slots running requests hold ÷ capacity, per rank: each rank has its own pool and admits "
            "on its own (alert SightlineKVCacheSaturated fires per rank).",
            "percentunit",
            [(q.gauge("sightline_kv_in_use_ratio", by=RANK, agg="max"), "{{instance}} rank {{dp_rank}}")],
            width=8,
            max_value=1,
        ),
        timeseries_panel(
            "Generated tokens/s by rank",
            "Tokens each rank samples per second (rate of "
            "sightline_scheduler_generated_tokens_total): the ranks' shares of the engine throughput.",
            "suffix: tokens/s",
            [(q.rate("sightline_scheduler_generated_tokens_total", by=RANK), "{{instance}} rank {{dp_rank}}")],
            width=8,
        ),
        timeseries_panel(
            "Prefix cache hit ratio by rank",
            "Prompt tokens reused ÷ prompt tokens admitted, per rank: each rank caches only the "
            "prefixes it has served, so a lower ratio on one rank means requests sharing a prefix "
            "were spread over ranks. No data for a rank without admissions.",
            "percentunit",
            [
                (
                    q.counter_ratio(
                        "sightline_prefix_cache_hits_tokens_total",
                        "sightline_prefix_cache_queries_tokens_total",
                        by=RANK,
                    ),
                    "{{instance}} rank {{dp_rank}}",
                )
            ],
            width=8,
            max_value=1,
        ),
        timeseries_panel(
            "Step time by rank",
            "Duration of each rank's latest engine step. A rank much slower "
            "than the others holds back the requests it runs.",
            "s",
            [(q.gauge("sightline_step_time_seconds", by=RANK, agg="max"), "{{instance}} rank {{dp_rank}}")],
            width=8,
        ),
        timeseries_panel(
            "In flight and open connections by worker",
            "Requests each tokenizer worker's TokenizerManager holds and HTTP connections open on it "
            "(--tokenizer-worker-num workers, label worker). Connections are spread by the kernel "
            "(SO_REUSEPORT), so a worker holding far more is slow or stuck. With one worker there is "
            "no worker label: one series each, legend without a number.",
            "short",
            [
                (q.gauge("sightline_requests_in_flight", by=WORKER), "in flight {{instance}} worker {{worker}}"),
                (q.gauge("sightline_http_connections_open", by=WORKER), "connections {{instance}} worker {{worker}}"),
            ],
            width=8,
        ),
        timeseries_panel(
            "CPU by process",
            "CPU seconds per second of each sightline process, by role (100 % = one core busy): main "
            "(the hub with several workers), worker-1, worker-2... (tokenizer workers), scheduler or "
            "scheduler_dp0, scheduler_dp1... (ranks), detokenizer. A worker near 100 %: tokenizing "
            "and HTTP saturate it — add workers; a rank near 100 % with a short step: the Scheduler's "
            "Python loop is the limit.",
            "percentunit",
            [(q.rate("sightline_process_cpu_seconds_total", by=ROLE), "{{instance}} {{role}}")],
            width=12,
        ),
        timeseries_panel(
            "Tokenizer workers up and worker failures",
            "Tokenizer workers up (HTTP server + TokenizerManager processes; 1 with one worker) and "
            "workers that died and were replaced, counted per rate interval. Each failure ended its "
            "streams and aborted its requests in the engine; 0 with one worker (the main process is "
            "the worker: if it dies the server is down), per instance.",
            "short",
            [
                (q.gauge("sightline_tokenizer_workers", by=INSTANCE), "workers up {{instance}}"),
                (WORKER_FAILURES, "worker failures {{instance}}"),
            ],
            width=12,
        ),
    ]


UP = (
    'up{job=~"$job", instance=~"$instance"}\nand on (job)\n'
    'sightline_build_info{job=~"$job"}'
)  # the scrape targets of sightline jobs only, down ones included


def replicas() -> list:
    """Which replica is bad? One series per instance (scrape target) of the service: the panels
    above sum the instances; these tell them apart."""
    return [
        timeseries_panel(
            "Request rate by instance",
            "Generation requests ending per second on each instance (rate of sightline_requests_total). "
            "Behind a least-connections balancer a slow replica gets fewer requests (it holds its "
            "connections longer); one at 0 while the others serve: it is out of rotation or down.",
            "reqps",
            [(q.rate(REQ, by=INSTANCE), "{{instance}}")],
            width=8,
        ),
        timeseries_panel(
            "5xx ratio by instance",
            "Share of each instance's ended generation requests answered with a 5xx. The availability "
            "SLO and its alert sum every instance; this shows whether one replica spends the budget.",
            "percentunit",
            [(q.ratio(REQ, ERRORS, by=INSTANCE), "{{instance}}")],
            width=8,
        ),
        timeseries_panel(
            "TTFT p99 by instance",
            "99th percentile time to first token per instance: one replica far above the others is "
            "slower (a busy host, a longer queue, a cold prefix cache).",
            "s",
            [(q.quantile(0.99, "sightline_time_to_first_token_seconds", by=INSTANCE), "{{instance}}")],
            width=8,
        ),
        timeseries_panel(
            "Waiting and in flight by instance",
            "Requests in each instance's Scheduler queues (all ranks) and requests its "
            "TokenizerManagers hold. A queue on one instance only: it is slower or the balancer "
            "sends it more.",
            "short",
            [
                (q.gauge("sightline_num_requests_waiting", by=INSTANCE), "waiting {{instance}}"),
                (q.gauge("sightline_requests_in_flight", by=INSTANCE), "in flight {{instance}}"),
            ],
            width=8,
        ),
        timeseries_panel(
            "KV usage by instance",
            "KV slots in use ÷ capacity of the fullest rank of each instance (alert "
            "SightlineKVCacheSaturated names the instance and rank).",
            "percentunit",
            [(q.gauge("sightline_kv_in_use_ratio", by=INSTANCE, agg="max"), "{{instance}}")],
            width=8,
            max_value=1,
        ),
        timeseries_panel(
            "Up by instance",
            "1 while Prometheus scrapes the instance, 0 when it cannot (alert SightlineDown names the "
            "instance). Only targets of jobs that expose sightline_build_info are shown.",
            "short",
            [(UP, "{{instance}}")],
            width=8,
            max_value=1,
        ),
    ]


def board() -> Board:
    b = Board(
        "sightline-overview",
        "Sightline / Overview",
        "Traffic, errors, latency and load of a sightline service at a glance: the panels sum every "
        "instance (replica) selected; the row Which replica is bad? tells them apart.",
    )
    b.row(
        "Traffic",
        timeseries_panel(
            "Requests by outcome",
            "Generation requests ending per second, by outcome (exactly one per request, so the "
            "stack is the request rate): stop, length; rejected (4xx before admission), shed (429), "
            "unavailable (503 while the engine starts or restarts); client_disconnect, timeout; "
            "error, engine_failure, shutdown, aborted_by_operator. The 5xx among them count against "
            "the availability SLO.",
            "reqps",
            [(q.rate(REQ, by=("outcome",)), "{{outcome}}")],
            stack=True,
        ),
        timeseries_panel(
            "Error ratio (5xx)",
            "Share of ended generation requests answered with a 5xx: the availability SLI.",
            "percentunit",
            [(q.ratio(REQ, ERRORS), "5xx ratio")],
            width=6,
        ),
        stat_panel(
            "Requests in flight",
            "Requests the TokenizerManager holds right now (rid_to_state size).",
            "short",
            [(q.gauge("sightline_requests_in_flight"), "in flight")],
            height=8,
            decimals=0,
        ),
        timeseries_panel(
            "Token throughput",
            "Prompt tokens and generated tokens of ended requests per second (as in `usage`).",
            "suffix: tokens/s",
            [
                (q.rate("sightline_prompt_tokens_total"), "prompt"),
                (q.rate("sightline_generation_tokens_total"), "generation"),
            ],
        ),
        timeseries_panel(
            "Running, waiting, in flight",
            "Requests in the running batch and in the Scheduler's waiting queue (from its stats "
            "messages), and requests the TokenizerManager holds. In flight far above running + "
            "waiting means requests are stuck between processes.",
            "short",
            [
                (q.gauge("sightline_num_requests_running"), "running"),
                (q.gauge("sightline_num_requests_waiting"), "waiting"),
                (q.gauge("sightline_requests_in_flight"), "in flight"),
            ],
        ),
        pause_panel(),
    )
    b.row("Which replica is bad?", *replicas())
    b.row(
        "Latency",
        latency_panel(
            "Time to first token",
            "HTTP arrival → first output token in the TokenizerManager (tokenize, queue, prefill and "
            "the hops included). p50 / p90 / p99 and mean.",
            "sightline_time_to_first_token_seconds",
        ),
        latency_panel(
            "Inter-token latency",
            "Gap between consecutive output tokens of a request, pooled over all requests.",
            "sightline_inter_token_latency_seconds",
        ),
        latency_panel(
            "Time per output token",
            "Per request: (e2e − TTFT) / (output tokens − 1). One long stall shows in ITL, not here.",
            "sightline_time_per_output_token_seconds",
        ),
        latency_panel(
            "End-to-end latency", "HTTP arrival → final output of the request.", "sightline_e2e_request_latency_seconds"
        ),
    )
    b.row(
        "Capacity",
        timeseries_panel(
            "KV cache usage",
            "Of the fullest rank of any instance (per instance: Which replica is bad?; per rank: "
            "Workers and ranks): KV slots running requests hold ÷ capacity (near 100 % decode steps "
            "retract requests) and committed ÷ capacity (held + the admission estimate of what they "
            "will still need; near 100 % new requests wait).",
            "percentunit",
            [
                (q.gauge("sightline_kv_in_use_ratio", agg="max"), "KV in use"),
                (q.gauge("sightline_kv_usage_ratio", agg="max"), "KV committed"),
            ],
        ),
        timeseries_panel(
            "Engine throughput",
            "Tokens the engine samples per second, as the Scheduler measures it.",
            "suffix: tokens/s",
            [(q.gauge("sightline_generation_throughput_tokens_per_second"), "generation")],
        ),
        cpu_per_token(),
    )
    b.row("Tenants", *tenant_panels())
    b.row("Workers and ranks", *workers_and_ranks())
    b.annotate(*control_annotations())
    return b
