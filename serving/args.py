"""`ServerArgs`: the one configuration object, validated once, turned into CLI flags.

Every field's `help` metadata is its documentation; `add_cli_args` makes a flag of
each (`--max-running-requests` for `max_running_requests`), so no knob exists that
the CLI cannot set.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from protocol.io_struct import SPECULATIVE_METHODS as SPECULATIVE

# OpenMP's wait between parallel regions, as environment variables libgomp reads when torch loads it
WAIT_POLICIES = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "brief": {"GOMP_SPINCOUNT": "30000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
# ... and how long the native kernels' idle workers spin before sleeping (microseconds)
TEAM_SPIN_US = {"passive": 0, "brief": 1000, "active": 10**9}


SPECULATIVE_METHODS = ("off", *SPECULATIVE)  # --speculative
MAX_SPECULATIVE_TOKENS = 16  # --speculative-num-tokens and the n-gram lengths at most
QUANTIZATIONS = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "int8")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerArgs:
    # -- model --------------------------------------------------------------
    model: str = _opt(
        "smollm2-135m", "Model to serve: 'smollm2-135m' (bundled), 'tiny-random', a .gguf file or a local HF directory."
    )
    served_model_name: str | None = _opt(None, "Name clients put in the `model` field (default: derived from --model).")
    cache_dir: str | None = _opt(
        None, "Where converted models are cached (default: $SIGHTLINE_CACHE_DIR or ~/.cache/sightline)."
    )
    context_length: int | None = _opt(
        None, "Maximum prompt + output tokens per request (default: the model's, capped by --max-total-tokens)."
    )
    # -- engine ---------------------------------------------------------------
    max_total_tokens: int = _opt(
        32768, "KV pool size in token slots (per layer); bounds the tokens of all running requests."
    )
    max_running_requests: int = _opt(64, "Most requests in the running batch at once.")
    admission: str = _opt(
        "estimate",
        "How the Scheduler admits requests into the batch: 'estimate' (a request's "
        "output counts as --init-new-token-ratio x min(max_tokens, --new-token-clip), "
        "the ratio adapting as requests finish or are retracted; a decode step that "
        "would run out of KV retracts requests and resumes them later with the same "
        "tokens) or 'reserve' (each request reserves prompt + max_tokens: never "
        "retracted, predictable latency, but a client that sets no max_tokens "
        "reserves the whole context window).",
    )
    init_new_token_ratio: float = _opt(
        0.7,
        "With --admission estimate: the share of its remaining (clipped) output "
        "a request is first expected to generate.",
    )
    min_new_token_ratio_factor: float = _opt(
        0.14, "With --admission estimate: the ratio decays to at most this factor x --init-new-token-ratio."
    )
    new_token_ratio_decay_steps: int = _opt(
        600,
        "With --admission estimate: decode steps without retraction over "
        "which the ratio decays from its initial value to its minimum.",
    )
    new_token_clip: int = _opt(
        2048,
        "With --admission estimate: the most remaining output tokens one request counts "
        "for in the estimate (and in --max-inflight-tokens).",
    )
    max_prefill_tokens: int = _opt(
        512, "Prompt tokens prefilled per step when no request is decoding; longer prompts are chunked across steps."
    )
    max_step_tokens: int = _opt(
        128,
        "While requests decode, a step feeds at most this many tokens (one per decoding "
        "request plus prefill chunks), so a long prompt cannot stall their inter-token "
        "latency (Sarathi-style stall-free batching).",
    )
    min_prefill_chunk: int = _opt(
        32,
        "Prompt tokens a step prefills at least (when prompts wait), however many "
        "requests decode, so prefill keeps progressing.",
    )
    step_time_factor: float = _opt(
        2.5,
        "While requests decode, a step's prefill is sized so that the step takes at most this many times the "
        "typical step (a pure-decode step of the batch the queue is heading to: running plus waiting requests), "
        "from step costs learned online (seconds per decode row and per prompt token); within "
        "--max-step-tokens and at least --min-prefill-chunk. The default 2.5 keeps a burst's inter-token p99 "
        "within 3x its p50 for about 1.15x the time to first token (docs/engine.md); lower: a shorter tail, "
        "a longer time to first token; 0: no time budget, the token caps alone.",
    )
    max_step_ms: float = _opt(
        0.0,
        "While requests decode, a step's prefill is also sized to keep the step within this many "
        "milliseconds (at least --min-prefill-chunk still runs); 0: no absolute limit.",
    )
    disable_prefix_cache: bool = _opt(
        False,
        "Turn off the prefix (radix) cache, which keeps finished requests' K/V in "
        "free KV slots so that prompts starting with the same tokens skip "
        "computing them.",
    )
    num_threads: int | None = _opt(
        None,
        "torch intra-op threads for the forward pass, per Scheduler rank (default: "
        "the CPUs this process may run on (its affinity: taskset, a cpuset) divided by --dp-size).",
    )
    thread_wait_policy: str = _opt(
        "passive",
        "How the Scheduler's idle compute threads wait between operations: "
        "'passive' (sleep: the cores stay free for the HTTP front end and the "
        "Detokenizer), 'brief' (spin about 1 ms, then sleep: awake through the "
        "back-to-back kernels of a step) or 'active' (spin: for cores nothing "
        "else uses). Sets OMP_WAIT_POLICY (or GOMP_SPINCOUNT) and the native "
        "kernels' team spin in the Scheduler process.",
    )
    kernel_worker_nice: int = _opt(
        10,
        "The nice of the native kernels' worker threads in the Scheduler (its own "
        "thread keeps the process's): a core's other work, the Detokenizer and "
        "the HTTP front end waking for each token, then preempts a worker, which "
        "costs the step only that worker's share, not the Scheduler's thread, "
        "which stalls it (one stream's inter-token latency ~7-10 percent lower on 2 "
        "cores). 0 to 19; 0 keeps them at the process's nice.",
    )
    dtype: str = _opt(
        "auto",
        "What the engine computes in: 'float32' (exact), 'bfloat16', or 'auto' (whichever a "
        "short matmul measurement at start-up finds faster on this CPU; logged).",
    )
    quantization: str = _opt(
        "auto",
        "Linear-layer weights (lm_head included): 'auto' (a .gguf file in its own types "
        "wherever the interleaved quantized kernel builds (AVX2 or AVX-512 VNNI), "
        "faster than float32 there; else expanded; any other model as 'none'), "
        "'gguf' (a .gguf file's own types, a quarter of the memory: Q8_0, "
        "Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K on a native int8 kernel; others expanded, "
        "logged), 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q4_k', 'q6_k' (quantized at "
        "load, int8 activations per 32 values), 'int8' (weight-only, one scale per output "
        "channel, bfloat16 activations: slower), or 'none' (weights in --dtype).",
    )
    linear_backend: str = _opt(
        "auto",
        "float32 linear layers (lm_head included): 'native' (a C++ kernel compiled "
        "with g++ for this CPU on first use and cached, weights repacked once at "
        "load), 'torch' (torch's matmul), or 'auto' (native when it builds here and "
        "the engine computes in float32, else torch; logged).",
    )
    attention_backend: str = _opt(
        "auto",
        "Decode attention: 'native' (a C++ kernel compiled with g++ on first use and "
        "cached, reading each request's K/V slots in place), 'sdpa' (torch's "
        "scaled_dot_product_attention over a padded copy), or 'auto' (native when it "
        "builds here, else sdpa; logged).",
    )
    logprobs_mode: str = _opt(
        "processed",
        "What the log-probabilities of sampled tokens (the API's logprobs) "
        "describe: 'processed' (the distribution the sampler draws from before "
        "top-k/top-p/min-p: the logits after logit_bias, penalties and the "
        "min_tokens mask, divided by the temperature) or 'raw' (the model's "
        "logits, untouched). Prompt logprobs are the model's in either mode.",
    )
    speculative: str = _opt(
        "off",
        "Speculative decoding: 'off', 'ngram' (prompt lookup: the tokens that followed the latest earlier "
        "occurrence of a request's last n tokens in its own prompt and output are proposed) or 'draft' (a smaller "
        "model of the same tokenizer, --speculative-model, proposes them greedily); drafts are verified in one "
        "forward, and the output is the one without it: greedy token for token, sampled in distribution.",
    )
    speculative_model: str | None = _opt(
        None,
        "With --speculative draft: the draft model (a name, directory or .gguf file as --model takes), with the "
        "target's tokenizer and fewer parameters; run in the engine process beside the target, its own KV pool.",
    )
    speculative_num_tokens: int = _opt(
        5, "With --speculative: the most draft tokens proposed per request and step (1 to 16; adapted per request)."
    )
    speculative_ngram_max: int = _opt(
        4, "With --speculative ngram: the longest suffix matched (tried first), in tokens (1 to 16)."
    )
    speculative_ngram_min: int = _opt(
        0,
        "With --speculative ngram: the shortest suffix matched, in tokens (1 to --speculative-ngram-max); 0: 1 "
        "with float weights, 2 with quantized ones (a verified row costs them more than one-token keys' guesses "
        "win back).",
    )
    enforce_eager: bool = _opt(
        False,
        "Run every step layer by layer from Python. By default a step whose every "
        "token decodes runs all layers in one native call when the linear layers, "
        "norms, RoPE and attention are all native kernels (float32 or quantized "
        "weights): the same kernels, bit-identical results, without ~12 Python calls "
        "a layer (as vLLM's --enforce-eager turns off its captured graphs).",
    )
    dp_size: int = _opt(
        1,
        "Data-parallel Scheduler ranks: N engine processes, each with its own model copy, KV pool "
        "and --num-threads (default: the cores split between them); each request goes to the rank "
        "with the fewest in-flight tokens (or, among nearly as idle ones, the rank its prompt's "
        "first tokens hash to, so a shared prefix finds its cache).",
        aliases=("--dp",),
    )
    tokenizer_worker_num: int = _opt(
        1,
        "Front-end worker processes, each an HTTP server and TokenizerManager on the "
        "same port (SO_REUSEPORT); with more than one, the main process supervises "
        "them and owns the metrics every worker answers /metrics with.",
    )
    pooling: str | None = _opt(
        None,
        "Serve embeddings (POST /v1/embeddings, /encode) by pooling the final hidden "
        "states: 'last' (the last token's), 'mean' or 'cls' (the first token's). A "
        "sentence-transformers model directory (modules.json and 1_Pooling) is an "
        "embedding model served with its own pooling, which this overrides; a generative "
        "model refuses embeddings without it.",
    )
    max_embedding_inputs: int = _opt(256, "Most inputs one embeddings request may carry.")
    random_seed: int = _opt(0, "Seeds the generators of requests that give no seed of their own.")
    # -- server -------------------------------------------------------------------
    host: str = _opt("127.0.0.1", "Address the HTTP server listens on.")
    port: int = _opt(8000, "Port the HTTP server listens on.")
    log_level: str = _opt("info", "Log level of every process: debug, info, warning, error.")
    heartbeat_interval: float = _opt(0.5, "Seconds between the idle Scheduler's stats/heartbeat messages.")
    decode_gap_factor: float = _opt(
        4.0,
        "An inter-token gap longer than this many times the median of the rank's "
        "recent step intervals (and than --decode-gap-floor) is a decode gap: its "
        "cause is recorded (sightline_decode_gaps_total, the decode span).",
    )
    decode_gap_floor: float = _opt(0.05, "Seconds: no inter-token gap shorter than this is a decode gap.")
    step_timeline_steps: int = _opt(
        4096,
        "Recent engine steps each Scheduler rank keeps for GET /debug/timeline and "
        "for finding decode gaps' causes; 0 turns the step timeline and decode-gap "
        "detection off.",
    )
    peak_probe: bool = _opt(
        True,
        "Measure the machine's peak FLOP/s (a float32 GEMM) and memory bandwidth (a "
        "64 MiB copy) on the engine's threads once at start (~0.1-0.3 s, startup phase "
        "peak_probe): the gauges the steps' FLOPs and bytes are held against. "
        "--no-peak-probe skips it on very small machines (the gauges stay 0).",
    )
    startup_timeout: float = _opt(600.0, "Seconds to wait for the Scheduler and Detokenizer to report ready.")
    max_stop_strings: int = _opt(16, "Most stop strings one request may give.")
    max_n: int = _opt(16, "Most choices (`n`) one OpenAI request may ask for.")
    max_choices: int = _opt(
        64,
        "Most choices one /v1/completions request may produce in all: `n` x the number of "
        "prompts in a batched `prompt`.",
    )
    responses_store_size: int = _opt(
        1024,
        "Responses kept for `previous_response_id` and GET /v1/responses/{id} "
        "(`store: true`), per front-end process, in memory; the least recently "
        "used is evicted beyond it (sightline_responses_store_evictions_total). "
        "0 stores none.",
    )
    allow_unknown_fields: bool = _opt(
        False,
        "Accept request bodies with fields this server does not know, ignoring "
        "them (counted in sightline_request_fields_ignored_total, named on the "
        "request's span). Default: refuse them with a 400 naming the field.",
    )
    chat_template: str | None = _opt(
        None,
        "A Jinja chat template (a file path, or the template itself) used instead "
        "of the tokenizer's for chat completions and /tokenize.",
    )
    trust_request_chat_template: bool = _opt(
        False,
        "Accept a request's own `chat_template` (vLLM's flag of the same "
        "name): a template is code run in the front end's event loop, so "
        "by default such requests are refused with a 400.",
    )
    tool_call_parser: str = _opt(
        "auto",
        "How chat answers are read for tool calls: 'hermes' (Qwen2, 2.5, 3: "
        "<tool_call> blocks), 'llama3_json' (Llama 3.x JSON calls), 'mistral' "
        "([TOOL_CALLS] lists), 'auto' (picked from the chat template's text, "
        "else hermes; the choice is logged at start) or 'none' (a request with "
        "tools must then say tool_choice none).",
    )
    reasoning_parser: str = _opt(
        "none",
        "How chat answers' thinking is told apart from the answer: 'qwen3' (an "
        "answer opening <think>), 'deepseek_r1' (the answer starts thinking "
        "unless chat_template_kwargs turns thinking off) or 'none'. The thinking "
        "goes to `reasoning_content`, its tokens to usage's reasoning_tokens, and "
        "a structured output or forced tool call starts after </think>.",
    )
    generation_config: str = _opt(
        "auto",
        "'auto': the model directory's generation_config.json supplies the "
        "defaults of temperature, top_p, top_k, min_p, repetition_penalty and "
        "max_tokens for requests that leave them unset (as vLLM); 'none': "
        "OpenAI's defaults.",
    )
    priority_order: str = _opt(
        "lower-first",
        "How request and tenant `priority` values are read: 'lower-first' "
        "(vLLM's: a lower value is served sooner; a request can ask no lower "
        "than its tenant's) or 'higher-first' (a higher value sooner; a "
        "request can ask no higher than its tenant's).",
    )
    max_prompt_chars: int | None = _opt(
        None,
        "Most characters in a prompt (or all chat messages together), refused "
        "before tokenizing (default: 16 per token of the context window).",
    )
    max_messages: int | None = _opt(
        None,
        "Most messages in one chat request (default: context window / 4, since each "
        "message costs at least 4 template tokens).",
    )
    allowed_hosts: str | None = _opt(
        None,
        "Host header names accepted, comma-separated; '*' accepts any (default: "
        "loopback names when --host is a loopback address, any otherwise). Guards "
        "against DNS rebinding.",
    )
    allowed_origins: str | None = _opt(
        None,
        "Browser origins that may call the API from their pages (CORS), "
        "comma-separated, e.g. 'http://localhost:3000'; '*' allows any. Default: "
        "none (no CORS headers, preflights refused).",
    )
    # -- reliability and security ----------------------------------------------------
    watchdog_timeout: float = _opt(
        60.0,
        "Seconds without a heartbeat from a child, while requests are in flight, "
        "before it counts as stalled (one engine step must fit in it, even on an "
        "overloaded CPU).",
    )
    stall_timeout: float = _opt(
        60.0, "/health fails when requests are in flight and no token was produced for this many seconds."
    )
    queue_stuck_timeout: float = _opt(
        30.0,
        "/health fails when the oldest waiting request of a Scheduler rank has "
        "waited this many seconds while the KV and batch room to admit it exist "
        "(a queue that admits nothing while tokens still flow).",
    )
    on_engine_failure: str = _opt(
        "restart", "When a child dies or stalls: 'restart' the engine processes (HTTP stays up) or 'exit'."
    )
    max_engine_restarts: int = _opt(
        5,
        "Most engine restart attempts within --engine-restart-window; when spent, the "
        "server stays up answering 503 until it is restarted from outside (0: never "
        "restart).",
    )
    engine_restart_window: float = _opt(300.0, "Seconds over which --max-engine-restarts is counted.")
    liveness_down_grace: float = _opt(
        60.0,
        "Once the restart budget is spent, seconds until /livez answers 503 too, "
        "so an orchestrator's liveness probe restarts the server (a Kubernetes "
        "pod); a negative value keeps /livez at 200.",
    )
    request_timeout: float | None = _opt(
        None, "Per-request deadline in seconds (a request may lower it with the x-request-timeout header)."
    )
    max_queue_time: float | None = _opt(
        None, "Seconds a request may wait in the Scheduler's queue before it is aborted."
    )
    max_queued_requests: int = _opt(256, "Requests accepted but not yet started; beyond it new requests get 429.")
    max_inflight_tokens: int | None = _opt(
        None,
        "KV tokens the in-flight requests are expected to need, as the "
        "Scheduler first estimates them: each request's prompt + its "
        "max_tokens (with --admission estimate: --init-new-token-ratio x "
        "min(max_tokens, --new-token-clip)); beyond it 429 (default: 4 x "
        "--max-total-tokens).",
    )
    shutdown_grace: float = _opt(30.0, "On SIGTERM, seconds in-flight requests may finish before they are aborted.")
    api_key: str | None = _opt(
        None,
        "Require 'Authorization: Bearer KEY' on /v1/* and /generate (default: "
        "$SIGHTLINE_API_KEY; prefer the variable: flags show in ps).",
    )
    api_keys_file: str | None = _opt(
        None,
        "A TOML file of API keys, each naming a tenant and a role (user | admin), "
        "and the tenants' priorities and limits (docs/reliability.md, Tenants and "
        "isolation); reloaded on SIGHUP and when it changes. With --api-key too, "
        "that key is tenant 'default', role admin.",
    )
    prefix_cache_sharing: str = _opt(
        "tenant",
        "Who may reuse whose cached prefixes: 'tenant' (only requests of one "
        "tenant, and of one cache_salt when given), 'salt-only' (every "
        "request without a cache_salt shares; a salt isolates) or 'global' "
        "(everyone shares; cache_salt is refused).",
    )
    max_tenant_labels: int = _opt(
        32,
        "Most tenants with their own `tenant` label value in the per-tenant metrics "
        "(the keys file's, in name order); the rest are counted as 'other'.",
    )
    auth_debug: bool = _opt(True, "With an API key, also require it on /debug/*.")
    auth_metrics: bool = _opt(False, "With an API key, also require it on /metrics.")
    control_from_anywhere: bool = _opt(
        False,
        "Without an API key, also accept the control endpoints "
        "(/pause_generation, /continue_generation, /control/*) from clients that "
        "are not on a loopback address (by default they answer those 403). With "
        "a key they always need it.",
    )
    max_request_bytes: int = _opt(4 * 1024 * 1024, "Largest request body accepted (413 beyond).")
    max_connections: int | None = _opt(
        None,
        "Most open HTTP connections; one more is answered 503 and closed at once "
        "(default: the open-files limit less max(64, 1/8 of it), kept for the "
        "server's own files).",
    )
    keep_alive_timeout: float = _opt(
        5.0,
        "Seconds a connection may sit idle between requests, or take to send "
        "complete request headers, before it is closed.",
    )
    body_read_timeout: float = _opt(
        30.0, "Seconds a request has to deliver its whole body once its headers are in (408 beyond)."
    )
    send_stall_timeout: float = _opt(
        30.0,
        "Seconds a response send may make no progress (client not reading, HTTP/2 "
        "window shut) before the stream is cut off and its request aborted as a "
        "client disconnect; an SSE stream is also cut off 1 s after its request's "
        "deadline.",
    )
    accept_error_log_interval: float = _opt(
        10.0,
        "Seconds between log lines about failing accept() calls (e.g. out of "
        "file descriptors); those in between are counted in the next line.",
    )
    # -- telemetry ----------------------------------------------------------------
    enable_metrics: bool = _opt(True, "Observe per-request Prometheus metrics (served at /metrics).")
    histogram_buckets: str | None = _opt(
        None,
        "Override histogram buckets per family, e.g. "
        "'ttft=0.05,0.1,0.2;itl=0.01,0.05' (families: ttft, itl, tpot, e2e, "
        "stage, tokens).",
    )
    enable_tracing: bool = _opt(
        True,
        "Build OpenTelemetry spans for sampled requests (kept for /debug/requests; "
        "exported per --otel-traces-exporter). Off with OTEL_SDK_DISABLED=true unless a "
        "flag asks for an export.",
    )
    otel_traces_exporter: str | None = _opt(
        None,
        "Span exporters, comma-separated: otlp, console, none (default: "
        "$OTEL_TRACES_EXPORTER, else otlp when an OTLP endpoint is set by "
        "flag or OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else none).",
    )
    otel_exporter_otlp_protocol: str | None = _opt(
        None, "OTLP protocol: http/protobuf or grpc (default: $OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL or http/protobuf)."
    )
    otel_exporter_otlp_endpoint: str | None = _opt(
        None, "OTLP base endpoint, e.g. http://127.0.0.1:4318 (default: the OTEL_EXPORTER_OTLP_* variables)."
    )
    otel_sampling_ratio: float | None = _opt(
        None,
        "Parent-based trace-id ratio for new traces (default: "
        "$OTEL_TRACES_SAMPLER / $OTEL_TRACES_SAMPLER_ARG, else 1.0).",
    )
    otel_tail_sampling: bool = _opt(
        True,
        "Tail sampling: record the requests head sampling left out and export, when "
        "each ends, the traces of those that errored, were aborted or shed, or "
        "breached the TTFT/TPOT thresholds (spans from every process).",
    )
    tail_sampling_ttft_ms: float | None = _opt(
        None,
        "Tail sampling keeps a request whose TTFT exceeded this (default: "
        "the TTFT SLO threshold of dashboards/slo.yaml, else 1000; 0: "
        "never for TTFT).",
    )
    tail_sampling_tpot_ms: float | None = _opt(
        None,
        "Tail sampling keeps a request whose TPOT exceeded this (default: "
        "the TPOT SLO threshold of dashboards/slo.yaml, else 100; 0: "
        "never for TPOT).",
    )
    tail_sampling_buffer_traces: int = _opt(
        4096, "Undecided traces tail sampling holds; past it the oldest is dropped and counted (reason buffer_full)."
    )
    tail_sampling_overrides_parent: bool = _opt(
        False,
        "Tail sampling also records a request whose caller sent a "
        "traceparent with sampled=0 (by default that choice is "
        "respected: nothing is recorded).",
    )
    otel_metrics_exporter: str | None = _opt(
        None,
        "OpenTelemetry GenAI metrics (gen_ai.server.*, token usage "
        "per --otel-genai-semconv) pushed beside /metrics; exporters, "
        "comma-separated: otlp, console, none (default: "
        "$OTEL_METRICS_EXPORTER, else otlp when a metrics endpoint is set "
        "by --otel-exporter-otlp-metrics-endpoint or "
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else none; the shared OTLP "
        "endpoint alone does not turn them on).",
    )
    otel_exporter_otlp_metrics_endpoint: str | None = _opt(
        None,
        "Full URL OTLP metrics are sent to, e.g. "
        "http://127.0.0.1:4318/v1/metrics (default: "
        "$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else "
        "--otel-exporter-otlp-endpoint or "
        "$OTEL_EXPORTER_OTLP_ENDPOINT with /v1/metrics). The "
        "protocol is --otel-exporter-otlp-protocol's (or "
        "$OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL).",
    )
    otel_metric_export_interval: int | None = _opt(
        None,
        "Milliseconds between OTLP metric exports; what is left is "
        "exported at shutdown (default: $OTEL_METRIC_EXPORT_INTERVAL, "
        "else 60000).",
    )
    otel_genai_semconv: str | None = _opt(
        None,
        "GenAI metric names pushed over OTLP: legacy (gen_ai.client.token."
        "usage), latest (gen_ai.client.inference.usage.* counters by "
        "gen_ai.token.modality, gen_ai.client.inference.operation.* "
        "histograms) or both, side by side (default: latest when "
        "$OTEL_SEMCONV_STABILITY_OPT_IN lists gen_ai_latest_experimental, "
        "else legacy).",
    )
    otel_metrics_catalogue: bool = _opt(
        False,
        "With an OTLP metrics exporter, also push every Prometheus metric of "
        "/metrics, the histograms this process observes as exponential "
        "histograms (docs/metrics.md).",
    )
    log_format: str = _opt("json", "Log format: json (one object per line, with rid/trace_id/span_id) or text.")
    log_requests: bool = _opt(
        True, "Log one INFO line per finished request with its latency breakdown (never the prompt or output)."
    )
    request_timeline_size: int = _opt(500, "Finished requests whose spans /debug/requests keeps in memory.")
    # -- KV-cache events for cache-aware routers (serving/engine/kv_event_publisher.py, docs/kv_events.md) --
    kv_events_endpoint: str | None = _opt(
        None,
        "Publish the prefix cache's block stores and evictions as vLLM's "
        "KV-cache events on this ZMQ endpoint (PUB; e.g. tcp://*:5557 binds, "
        "tcp://router:5557 connects); rank r of --dp-size adds r to the port. "
        "Off by default.",
    )
    kv_events_replay_endpoint: str | None = _opt(
        None,
        "With --kv-events-endpoint: a ZMQ ROUTER endpoint (bound) where "
        "a subscriber asks for the batches it missed from a sequence "
        "number on.",
    )
    kv_events_topic: str = _opt(
        "", "With --kv-events-endpoint: the topic frame of every message (llm-d's indexer reads kv@<pod-ip>@<model>)."
    )
    kv_events_block_size: int = _opt(
        16, "With --kv-events-endpoint: tokens per hashed block (the router's block size)."
    )
    kv_events_hash_seed: str = _opt(
        "",
        "With --kv-events-endpoint: the seed of the block-hash chain (the router's hashSeed, vLLM's PYTHONHASHSEED).",
    )
    kv_events_token_ids: bool = _opt(
        False,
        "With --kv-events-endpoint: put each stored block's token ids in its "
        "event (off: only hashes leave the server).",
    )
    kv_events_hwm: int = _opt(
        100_000,
        "With --kv-events-endpoint: messages queued per subscriber before further "
        "batches are dropped (counted; the subscriber can replay them).",
    )
    kv_events_connect_timeout: float = _opt(
        10.0,
        "With a --kv-events-endpoint to connect to: seconds the Scheduler "
        "waits for the connection before the start fails (0: do not "
        "wait).",
    )
    # -- flight recorder and crash dumps (telemetry/flight_recorder.py, serving/frontend/supervision/crash_dump.py) --
    dump_requests: str | None = _opt(
        None,
        "Directory to record every generation or embeddings request in, one "
        "JSON line each (telemetry/request_record.py: arrival, route, sampling "
        "parameters, token counts, outcome, latency breakdown, prompt/output "
        "lengths and SHA-256), in rotating requests-*.jsonl files; crash dumps go "
        "there too. Written by a background thread: a write error is counted, "
        "never a failed request.",
    )
    dump_content: bool = _opt(
        False,
        "With --dump-requests, also record the prompt (or chat messages), stop strings "
        "and output text (by default only their lengths and SHA-256).",
    )
    dump_requests_max_file_mb: float = _opt(
        64.0, "With --dump-requests, MiB after which a new requests-*.jsonl file is started."
    )
    dump_requests_max_files: int = _opt(
        10,
        "With --dump-requests, most requests-*.jsonl files kept in the directory "
        "(every tokenizer worker's together); the oldest are deleted.",
    )
    crash_dump_dir: str | None = _opt(
        None,
        "Directory for crash dumps (crash-<UTC time>/: the last requests, engine "
        "stats, in-flight requests, the failure, live processes' Python stacks), "
        "written when an engine process dies or stalls (default: the "
        "--dump-requests directory; none without either).",
    )
    crash_dump_requests: int = _opt(
        200,
        "Most recent request records a crash dump holds (kept in memory while "
        "--dump-requests or --crash-dump-dir is set).",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in (
            "max_total_tokens",
            "max_running_requests",
            "max_prefill_tokens",
            "max_step_tokens",
            "min_prefill_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not (self.step_time_factor == 0 or 1 <= self.step_time_factor <= 1000):
            raise ValueError("--step-time-factor must be 0 (off) or between 1 and 1000 (x a pure-decode step)")
        if not 0 <= self.max_step_ms <= 3_600_000:
            raise ValueError("--max-step-ms must be between 0 (no limit) and 3600000")
        if self.pooling is not None and self.pooling not in ("last", "mean", "cls"):
            raise ValueError("--pooling must be last, mean or cls")
        if self.max_embedding_inputs < 1:
            raise ValueError("--max-embedding-inputs must be >= 1")
        if self.admission not in ("estimate", "reserve"):
            raise ValueError("--admission must be estimate or reserve")
        if not 0 < self.init_new_token_ratio <= 1 or not 0 < self.min_new_token_ratio_factor <= 1:
            raise ValueError("--init-new-token-ratio and --min-new-token-ratio-factor must be in (0, 1]")
        if self.new_token_ratio_decay_steps < 1 or self.new_token_clip < 1:
            raise ValueError("--new-token-ratio-decay-steps and --new-token-clip must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("--context-length must be >= 2")
        if not 1 <= self.dp_size <= 64 or not 1 <= self.tokenizer_worker_num <= 64:
            raise ValueError("--dp-size and --tokenizer-worker-num must be in [1, 64]")
        if self.tokenizer_worker_num > 1 and self.port == 0:
            raise ValueError("--tokenizer-worker-num > 1 needs a fixed --port (the workers share it)")
        if not 1 <= self.max_n <= self.max_choices:
            raise ValueError("--max-n must be >= 1 and at most --max-choices")
        if not 0 <= self.responses_store_size <= 1_000_000:
            raise ValueError("--responses-store-size must be in [0, 1000000]")
        if self.chat_template and not os.path.isfile(self.chat_template) and "{" not in self.chat_template:
            raise ValueError(f"--chat-template: {self.chat_template!r} is neither a file nor a Jinja template")
        from telemetry.metrics import TOOL_CALL_PARSERS

        if self.tool_call_parser not in ("auto", *TOOL_CALL_PARSERS, "none"):
            raise ValueError(f"--tool-call-parser must be one of auto, {', '.join(TOOL_CALL_PARSERS)}, none")
        if self.reasoning_parser not in ("qwen3", "deepseek_r1", "none"):
            raise ValueError("--reasoning-parser must be qwen3, deepseek_r1 or none")
        if self.generation_config not in ("auto", "none"):
            raise ValueError("--generation-config must be auto or none")
        if self.priority_order not in ("lower-first", "higher-first"):
            raise ValueError("--priority-order must be lower-first or higher-first")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("--num-threads must be >= 1")
        if not 0 <= self.kernel_worker_nice <= 19:
            raise ValueError("--kernel-worker-nice must be between 0 and 19")
        if self.thread_wait_policy not in WAIT_POLICIES:
            raise ValueError(f"--thread-wait-policy must be one of {', '.join(WAIT_POLICIES)}")
        if self.dtype not in ("auto", "float32", "bfloat16") or self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"--dtype must be auto, float32 or bfloat16; --quantization one of {', '.join(QUANTIZATIONS)}"
            )
        if self.quantization == "int8" and self.dtype == "float32":
            raise ValueError("--quantization int8 computes with bfloat16 activations: use --dtype bfloat16 or auto")
        if self.linear_backend not in ("auto", "native", "torch"):
            raise ValueError("--linear-backend must be auto, native or torch")
        if self.attention_backend not in ("auto", "native", "sdpa"):
            raise ValueError("--attention-backend must be auto, native or sdpa")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        if not 1 <= self.speculative_num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-num-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_num_tokens}"
            )
        if (self.speculative == "draft") != bool(self.speculative_model):
            raise ValueError("--speculative draft and --speculative-model go together: give both or neither")
        n_min = self.speculative_ngram_min or 1  # 0: chosen from the weights' precision, 1 or 2
        if not 1 <= n_min <= self.speculative_ngram_max <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "--speculative-ngram-min and --speculative-ngram-max must satisfy "
                f"1 <= min <= max <= {MAX_SPECULATIVE_TOKENS} (min 0: chosen from the precision), got "
                f"{self.speculative_ngram_min} and {self.speculative_ngram_max}"
            )
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError("--logprobs-mode must be processed or raw")
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("--log-level must be one of debug, info, warning, error")
        if self.on_engine_failure not in ("restart", "exit"):
            raise ValueError("--on-engine-failure must be restart or exit")
        if self.max_engine_restarts < 0:
            raise ValueError("--max-engine-restarts must be >= 0")
        for name in ("watchdog_timeout", "stall_timeout", "request_timeout", "max_queue_time", "engine_restart_window"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        for name in ("keep_alive_timeout", "body_read_timeout", "send_stall_timeout", "accept_error_log_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if self.max_queued_requests < 1 or self.max_request_bytes < 1024 or self.shutdown_grace < 0:
            raise ValueError("--max-queued-requests >= 1, --max-request-bytes >= 1024, --shutdown-grace >= 0")
        if self.prefix_cache_sharing not in ("tenant", "global", "salt-only"):
            raise ValueError("--prefix-cache-sharing must be tenant, global or salt-only")
        if self.max_tenant_labels < 1:
            raise ValueError("--max-tenant-labels must be >= 1")
        if self.api_key is None:
            self.api_key = os.environ.get("SIGHTLINE_API_KEY") or None
        for origin in (self.allowed_origins or "").split(","):
            origin = origin.strip().rstrip("/")
            if origin and origin != "*" and (not origin.startswith(("http://", "https://")) or "/" in origin[8:]):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin like http://host:port (or '*')")
        if self.log_format not in ("json", "text"):
            raise ValueError("--log-format must be json or text")
        if self.otel_sampling_ratio is not None and not 0.0 <= self.otel_sampling_ratio <= 1.0:
            raise ValueError("--otel-sampling-ratio must be in [0, 1]")
        if self.tail_sampling_buffer_traces < 1:
            raise ValueError("--tail-sampling-buffer-traces must be >= 1")
        for name in ("tail_sampling_ttft_ms", "tail_sampling_tpot_ms"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("max_prompt_chars", "max_messages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.dump_requests_max_file_mb <= 0 or self.dump_requests_max_files < 1 or self.crash_dump_requests < 0:
            raise ValueError(
                "--dump-requests-max-file-mb must be > 0, --dump-requests-max-files >= 1, --crash-dump-requests >= 0"
            )
        if self.request_timeline_size < 0:
            raise ValueError("--request-timeline-size must be >= 0")
        from telemetry.buckets import parse_bucket_overrides
        from telemetry.tracing import resolve_exporters

        parse_bucket_overrides(self.histogram_buckets)
        resolve_exporters(self.otel_traces_exporter)
        from telemetry.genai_metrics import resolve_metrics_exporters

        resolve_metrics_exporters(self.otel_metrics_exporter)
        from telemetry.genai_instruments import resolve_semconv

        resolve_semconv(self.otel_genai_semconv, {})
        if self.otel_metric_export_interval is not None and self.otel_metric_export_interval < 1:
            raise ValueError("--otel-metric-export-interval must be >= 1 (milliseconds)")
        if self.heartbeat_interval <= 0 or self.startup_timeout <= 0:
            raise ValueError("--heartbeat-interval and --startup-timeout must be > 0")
        if self.queue_stuck_timeout <= 0:
            raise ValueError("--queue-stuck-timeout must be > 0")
        if self.kv_events_endpoint is not None:
            if self.disable_prefix_cache:
                raise ValueError("--kv-events-endpoint needs the prefix cache (drop --disable-prefix-cache)")
            for flag, value in (
                ("endpoint", self.kv_events_endpoint),
                ("replay-endpoint", self.kv_events_replay_endpoint),
            ):
                if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                    raise ValueError(f"--kv-events-{flag} must be a ZMQ endpoint: tcp://host:port, ipc:// or inproc://")
            if self.kv_events_block_size < 1 or self.kv_events_hwm < 1 or self.kv_events_connect_timeout < 0:
                raise ValueError(
                    "--kv-events-block-size and --kv-events-hwm must be >= 1, --kv-events-connect-timeout >= 0"
                )

    @property
    def cache_dir_path(self) -> Path | None:
        return Path(self.cache_dir).expanduser() if self.cache_dir else None

    @property
    def inflight_token_limit(self) -> int:
        return self.max_inflight_tokens or 4 * self.max_total_tokens

    def expected_tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The KV tokens a new request is first expected to need: what the front end charges and balances on."""
        if self.admission == "reserve":
            return prompt_tokens + max_new_tokens
        return prompt_tokens + round(self.init_new_token_ratio * min(max_new_tokens, self.new_token_clip))

    def __repr__(self) -> str:  # never print the API key
        fields = ", ".join(
            f"{f.name}={'***' if f.name == 'api_key' and self.api_key else getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
        )
        return f"ServerArgs({fields})"

    @property
    def threads(self) -> int:
        return self.num_threads or max(1, len(os.sched_getaffinity(0)) // self.dp_size)

    # -- CLI ------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            typ = hints[f.name]
            base = next((t for t in getattr(typ, "__args__", (typ,)) if t is not type(None)), str)
            if base is bool:
                parser.add_argument(
                    *flags, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"]
                )
            else:
                parser.add_argument(
                    *flags,
                    dest=f.name,
                    type=base,
                    default=f.default,
                    help=f.metadata["help"] + f" [default: {f.default}]",
                )

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
