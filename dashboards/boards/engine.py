"""Engine: what the Scheduler's continuous batching is doing, from its stats messages."""

from __future__ import annotations

from dashboards import promql as q
from dashboards.panels import Board, stat_panel, timeseries_panel
from dashboards.rules import PEAK_PAIRS

KV = ("used", "in_use", "reserved", "capacity")
PREFIX_HIT_RATIO = q.counter_ratio(
    "sightline_prefix_cache_hits_tokens_total", "sightline_prefix_cache_queries_tokens_total"
)


def board() -> Board:
    b = Board(
        "sightline-engine",
        "Sightline / Engine",
        "Batch size, step time, KV slots, admission and retraction, prefix cache, chunked prefill and "
        "throughput of the Scheduler.",
    )
    b.row(
        "Batching",
        timeseries_panel(
            "Batch size",
            "Requests in the latest engine step (decode and prefill chunks together); "
            "with several ranks or instances the largest (per rank: Overview → Workers and ranks).",
            "short",
            [(q.gauge("sightline_batch_size", agg="max"), "batch size")],
            width=8,
        ),
        timeseries_panel(
            "Step time",
            "Duration of the latest engine step (one forward pass + sampling); with "
            "several ranks or instances the slowest (per rank: Overview → Workers and ranks).",
            "s",
            [(q.gauge("sightline_step_time_seconds", agg="max"), "step time")],
            width=8,
        ),
        timeseries_panel(
            "Steps per second",
            "Engine steps run per second, all ranks and instances together; 0 with requests waiting = stalled.",
            "ops",
            [(q.rate("sightline_scheduler_steps_total"), "steps/s")],
            width=8,
        ),
    )
    b.row(
        "Utilisation",
        timeseries_panel(
            "Achieved fraction of the machine's peak",
            "The steps' FLOPs and bytes per second (counted "
            "from the model's shape: sightline_engine_flops_total, _bytes_total) ÷ the peak compute "
            "(a float32 GEMM) and bandwidth (a memory copy) each rank measured on its own threads at "
            "start, of the busiest rank of any instance. Slow steps near 1 on either: the box is the "
            "limit (more cores, a smaller dtype); far below both: the code is (runbook → Slow steps, "
            "far from the machine's peak). No data with --no-peak-probe.",
            "percentunit",
            [
                (f"max({q.per_peak(work, peak)})", kind)
                for kind, (work, peak) in (("compute", PEAK_PAIRS["flops"]), ("bandwidth", PEAK_PAIRS["bytes"]))
            ],
            width=24,
        ),
    )
    b.row(
        "Step phases",
        timeseries_panel(
            "Where a step's time goes",
            "Mean duration of each phase of an engine step: schedule "
            "(admission, chunking), forward (batch metadata + the model), sample (logits → tokens), "
            "output (outputs sent to the Detokenizer). Stacked: the top is the mean step.",
            "s",
            [(q.mean("sightline_engine_step_phase_seconds", by=("phase",)), "{{phase}}")],
            stack=True,
        ),
        timeseries_panel(
            "Step phase p99",
            "99th percentile of each phase: a tall forward with a short mean is a "
            "stall (a long prefill chunk, threads descheduled).",
            "s",
            [(q.quantile(0.99, "sightline_engine_step_phase_seconds", by=("phase",)), "{{phase}}")],
        ),
    )
    b.row(
        "KV cache",
        timeseries_panel(
            "KV slots",
            "Token slots in the KV pool: holding keys/values (used, the prefix cache's "
            "included), held by running requests (in_use: their own and the cached prefixes they lock), "
            "committed to them (reserved: in_use plus the admission policy's estimate of what they will "
            "still allocate), the pool size (capacity), and the slots the prefix cache holds. Idle, "
            "used equals the prefix cache and in_use and reserved are 0; used above the prefix cache "
            "with nothing running is a leak.",
            "short",
            [
                *((q.gauge(f"sightline_kv_slots_{k}"), k) for k in KV),
                (q.gauge("sightline_prefix_cache_tokens"), "prefix cache"),
            ],
        ),
        timeseries_panel(
            "KV usage ratio",
            "Of the fullest rank of any instance (each rank has its own pool; the "
            "slots panel sums them): in use ÷ capacity (what routers read; at 1 the next decode step "
            "retracts requests, alert SightlineKVCacheSaturated) and committed ÷ capacity (new "
            "requests wait when their own expected need no longer fits; with --admission estimate it "
            "may pass 1 as requests outgrow the estimate).",
            "percentunit",
            [
                (q.gauge("sightline_kv_in_use_ratio", agg="max"), "in use"),
                (q.gauge("sightline_kv_usage_ratio", agg="max"), "committed"),
            ],
        ),
    )
    b.row(
        "Admission and retraction",
        timeseries_panel(
            "Retractions",
            "Running requests taken out of the batch per second because a decode step "
            "would not have found KV for every one (left), and the K/V positions they had and those "
            "computed again when they resumed (right): recomputed ÷ retracted near 0 means resumptions "
            "were prefix-cache hits (retracted K/V is pinned in the cache, evicted last); equal with "
            "--disable-prefix-cache. Sustained: alert SightlineRetractionsSustained.",
            "ops",
            [
                (q.rate("sightline_retractions_total"), "retractions/s"),
                (q.rate("sightline_retracted_tokens_total"), "retracted tokens/s"),
                (q.rate("sightline_retraction_recomputed_tokens_total"), "recomputed tokens/s"),
            ],
            right={"B": "suffix: tokens/s", "C": "suffix: tokens/s"},
            width=16,
        ),
        timeseries_panel(
            "New-token ratio",
            "The admission estimate of the share of its remaining (clipped) output "
            "a running request will still generate, of the most cautious rank: it decays step by step "
            "and jumps back up after a retraction; 1 with --admission reserve.",
            "percentunit",
            [(q.gauge("sightline_new_token_ratio", agg="max"), "ratio")],
            max_value=1,
            width=8,
        ),
    )
    b.row(
        "Queue head and KV events",
        timeseries_panel(
            "Queue head and admissions",
            "How long the oldest waiting request of the most delayed "
            "rank has waited (left), requests admitted per second (right) and whether the next request "
            "to admit would fit now (right, 1 = KV and batch room exist). The head aging while it fits "
            "and nothing is admitted is a stuck queue (alert SightlineQueueStuck, /health after "
            "--queue-stuck-timeout), even while running requests still produce tokens; aging without "
            "fitting is saturation (KV or --max-running-requests).",
            "s",
            [
                (q.gauge("sightline_queue_head_age_seconds", agg="max"), "oldest waiting"),
                (q.rate("sightline_scheduler_admissions_total"), "admitted/s"),
                (q.gauge("sightline_queue_head_fits", agg="max"), "head fits"),
            ],
            right={"B": "ops", "C": "short"},
        ),
        timeseries_panel(
            "KV-cache events",
            "Block events (stored, removed, cleared) published per second to "
            "cache-aware routers on --kv-events-endpoint, and those dropped because the publisher's "
            "queue was full or a subscriber reached --kv-events-hwm (the subscriber can replay them by "
            "sequence number). 0 with the flag off.",
            "suffix: events/s",
            [
                (q.rate("sightline_kv_events_published_total"), "published"),
                (q.rate("sightline_kv_events_dropped_total"), "dropped"),
            ],
        ),
    )
    b.row(
        "Prefix cache",
        timeseries_panel(
            "Prefix cache hit ratio",
            "Prompt tokens reused from the prefix cache ÷ prompt tokens of "
            "the requests admitted (vLLM's hits ÷ queries): the share of prefill the cache saved. No "
            "data without admissions; 0 with --disable-prefix-cache.",
            "percentunit",
            [(PREFIX_HIT_RATIO, "hit ratio")],
            max_value=1,
        ),
        timeseries_panel(
            "Prefix cache size and evictions",
            "KV slots the prefix cache holds (left; part of KV "
            "used) and cached slots evicted per second to make room (right, least recently used "
            "first). Steady evictions with a falling hit ratio: the pool is too small for the prefixes "
            "in use. A drop to 0 without evictions is a POST /flush_cache.",
            "short",
            [
                (q.gauge("sightline_prefix_cache_tokens"), "cached tokens"),
                (q.rate("sightline_prefix_cache_evicted_tokens_total"), "evicted tokens/s"),
            ],
            right={"B": "suffix: tokens/s"},
        ),
    )
    b.row(
        "Prefill and throughput",
        timeseries_panel(
            "Chunked prefill activity",
            "Prompt tokens prefilled per second (all chunks) and the "
            "prompt tokens of requests arriving: a gap means prefill falls behind.",
            "suffix: tokens/s",
            [
                (q.rate("sightline_scheduler_prefill_tokens_total"), "prefilled"),
                (q.rate("sightline_prompt_tokens_total"), "prompt tokens of ended requests"),
            ],
            width=8,
        ),
        timeseries_panel(
            "Generation throughput",
            "Tokens sampled per second: the engine's own moving figure and the rate of its counter.",
            "suffix: tokens/s",
            [
                (q.gauge("sightline_generation_throughput_tokens_per_second"), "engine gauge"),
                (q.rate("sightline_scheduler_generated_tokens_total"), "counter rate"),
            ],
            width=8,
        ),
        stat_panel(
            "Seconds since last token",
            "Seconds since the engine last sampled a token, the longest of "
            "any rank and instance (an idle replica reads high). With requests in flight, a growing value "
            "is a stalled engine (alert SightlineEngineStalled).",
            "s",
            [(q.gauge("sightline_seconds_since_last_token", agg="max"), "since last token")],
            width=8,
            height=8,
            decimals=1,
        ),
    )
    b.row(
        "Structured outputs",
        timeseries_panel(
            "Grammar compiles",
            "Compile time of structured-output grammars not cached (p50, p99; "
            "left) and the share of structured requests whose grammar was cached or compiling already "
            "(right). A request waits for its compile with wait reason grammar (Troubleshooting → why "
            "requests waited); a low hit ratio with slow compiles: specs that change per request "
            "(a timestamp or id in the schema).",
            "s",
            [
                (q.quantile(0.5, "sightline_grammar_compile_seconds"), "compile p50"),
                (q.quantile(0.99, "sightline_grammar_compile_seconds"), "compile p99"),
                (q.ratio("sightline_grammar_cache_total", 'result="hit"'), "cache hit ratio"),
            ],
            right={"C": "percentunit"},
            width=8,
        ),
        timeseries_panel(
            "Grammar work per step",
            "Mean time per step spent filling and applying grammar masks and "
            "feeding the sampled tokens to the matchers (the step's grammar phase; left), and tokens the "
            "grammar alone decided (a mask with one token allowed; right). A grammar phase growing with "
            "the batch: many structured requests at once, or schemas whose masks are costly.",
            "s",
            [
                (q.mean("sightline_engine_step_phase_seconds", 'phase="grammar"'), "grammar phase"),
                (q.rate("sightline_grammar_forced_tokens_total"), "forced tokens/s"),
            ],
            right={"B": "suffix: tokens/s"},
            width=8,
        ),
        timeseries_panel(
            "Structured outputs that failed",
            "Requests a grammar ended with an error, by kind "
            "(compile: the engine could not compile a spec the front end let through; dead_end: no token "
            "left to draw), and tool calls the front end could not parse, by parser (their text came "
            "back as content: runbook → Tool calls come back as text).",
            "ops",
            [
                (q.rate("sightline_grammar_errors_total", by=("kind",)), "grammar {{kind}}"),
                (q.rate("sightline_tool_call_parse_failures_total", by=("parser",)), "tool call parse {{parser}}"),
            ],
            width=8,
        ),
    )
    b.row(
        "Startup and recovery",
        timeseries_panel(
            "Startup phases",
            "How long each phase of each process's latest start took (main: imports, "
            "args, spawn; scheduler: imports, model_resolve, native_kernels, weight_load, kv_pool, "
            "peak_probe; detokenizer: imports, tokenizer_load), stacked per process; a restarted child's "
            "phases replace its previous start's. The same phases are `startup.*` spans, and /health "
            "names the phase under way while a child starts.",
            "s",
            [(q.gauge("sightline_startup_phase_seconds", by=("role", "phase"), agg="max"), "{{role}} {{phase}}")],
            stack=True,
        ),
        timeseries_panel(
            "Engine recovery",
            "Seconds spent recovering per rate interval: from each engine failure "
            "to the engine ready again, backoff, failed attempts and the new children's start included "
            "(left; 0 while nothing failed; alert SightlineEngineRecoverySlow when one recovery passes "
            "its budget), and recoveries per rate interval (right): their ratio is the mean recovery.",
            "s",
            [
                (q.rate("sightline_engine_recovery_seconds_sum", fn="increase"), "seconds recovering"),
                (q.rate("sightline_engine_recovery_seconds_count", fn="increase"), "recoveries"),
            ],
            right={"B": "short"},
        ),
    )
    b.row(
        "Request sizes",
        *(
            timeseries_panel(
                title,
                f"{what} per request, p50 and p99.",
                "short",
                [(q.quantile(x, metric), f"p{round(x * 100)}") for x in (0.5, 0.99)],
            )
            for title, what, metric in (
                ("Prompt length", "Prompt tokens", "sightline_request_prompt_tokens"),
                ("Output length", "Output tokens", "sightline_request_generation_tokens"),
            )
        ),
    )
    return b
