"""The wire contract: every message that crosses a ZMQ socket, in one file.

Typed msgspec structs in a tagged union, msgpack on the wire — never pickling (a
pickled socket is a remote-code-execution hole).  Two rules hold for every message:

* it carries `sent_at` (monotonic ns, `telemetry.clock.now_ns`), so the receiver can
  observe the hop's latency;
* for each rid it concerns it carries a `ReqMeta`: the W3C trace carrier and the
  timestamps that rid has gathered so far, so the main process can compute every
  per-request latency and every process can parent its spans, without side channels.

Edges (one PUSH→PULL socket each; N tokenizer workers and `dp` Scheduler ranks each
have their own receiving socket):
  TokenizerManager → Scheduler rank     TokenizedGenerateReqInput, TokenizedEmbeddingReqInput, AbortReq,
                                        FlushCacheReq, StepTimelineReq, BarrierReq,
                                        PauseReq, ContinueReq, SetLogLevelReq (operator controls),
                                        ReleaseHeldReq (the tests' hold seam)
  Scheduler → Detokenizer               BatchTokenIDOutput, BatchEmbeddingOutput, BarrierReq
  Detokenizer → the rid's worker        BatchStrOutput (routed by `TokenOut.worker`), BatchEmbeddingOutput (passed
                                        through, routed by `EmbeddingOut.worker`), BarrierReq (to its `worker`)
  Scheduler, Detokenizer → control      SchedulerStats, DetokenizerStats (heartbeat + gauges),
                                        StartupProgress, Ready, FlushCacheReqOutput, StepTimelineOutput, BarrierReq
With one worker the TokenizerManager owns the control socket.  With several, the main
process (the hub: supervisor and telemetry owner) does, and speaks to each worker:
  hub → worker       EngineStatus, FlushCacheReqOutput, StepTimelineOutput, BarrierReq, SnapshotReq, HubReply
  worker → hub       WorkerStats, HubQuery, Snapshot
  hub → Scheduler, Detokenizer   WorkerGone (a worker died: drop its rids)
"""

from __future__ import annotations

from typing import Union

import msgspec

from protocol.sampling_params import SamplingParams


class Stamps(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Monotonic-ns timestamps of one rid, filled in as it travels (None = not yet)."""

    arrival: int | None = None  # HTTP handler entered (TM)
    tokenized: int | None = None  # prompt tokenized, request sent (TM)
    sched_recv: int | None = None  # Scheduler received it; it waits in the queue from here
    scheduled: int | None = None  # first admitted into a batch
    waited: int | None = None  # ns in the Scheduler's queue over every waiting interval (retractions re-queue)
    wait_reasons: dict[str, int] | None = None  # `waited` by reason (serving.engine.wait_reasons), on the last output
    first_token: int | None = None  # first output token sampled
    last_token: int | None = None  # latest output token sampled
    finished: int | None = None  # finished or aborted in the Scheduler
    sched_sent: int | None = None  # the Scheduler sent the latest output (its message's sent_at)
    detok_recv: int | None = None  # Detokenizer received the latest tokens
    detok_done: int | None = None  # Detokenizer finished decoding them


class ReqMeta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What travels with a rid in every message: trace context and timestamps."""

    trace: dict[str, str] = {}  # {"traceparent": ..., "tracestate": ...}; empty when not traced
    stamps: Stamps = msgspec.field(default_factory=Stamps)


class DetokParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How the Detokenizer turns this rid's tokens into text (rides the first output)."""

    stop: list[str] = []  # stop strings: trimmed from the output, finish_reason "stop"
    skip_special_tokens: bool = True
    prompt_tail: list[int] = []  # last prompt tokens: decode context for the first output token
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text (vLLM's field)


class _Msg(msgspec.Struct, tag=True, kw_only=True):
    sent_at: int = 0


# -- TokenizerManager → Scheduler ---------------------------------------------------
class TokenizedGenerateReqInput(_Msg):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    detok: DetokParams
    meta: ReqMeta
    worker: int = 0  # the tokenizer worker holding the rid's ReqState: its outputs go back there
    priority: int = 0  # its tenant's: higher is admitted first and retracted last
    cache_namespace: str = ""  # the prefix-cache namespace it reads and fills (a digest; "" is shared)


class TokenizedEmbeddingReqInput(_Msg):
    """One embeddings request (POST /v1/embeddings, /encode): every input's token ids.  The Scheduler runs each
    input as its own prefill-only request and answers once for all (`EmbeddingOut`); an error or abort of any
    input ends the whole request with a `TokenOut` (through the Detokenizer, as for generation)."""

    rid: str
    inputs: list[list[int]]
    pooling: str  # last | mean | cls (serving.engine.embedding)
    meta: ReqMeta
    worker: int = 0
    priority: int = 0
    cache_namespace: str = ""


class FlushCacheReq(_Msg):
    """Empty the Scheduler's prefix cache (SGLang's /flush_cache); refused while requests run unless `force`."""

    id: str  # matches the reply
    force: bool = False
    worker: int = 0  # who asked: the reply goes back there


class StepTimelineReq(_Msg):
    """Send the recent engine steps (GET /debug/timeline): those that ended in the last `seconds`."""

    id: str  # matches the reply
    seconds: float = 10.0
    worker: int = 0  # who asked: the reply goes back there


class BarrierReq(_Msg):
    """A marker pushed through the pipeline (POST /debug/barrier).  Every link is a FIFO socket, so once
    a rank's marker is back on both paths, everything sent before it has been handled: the Scheduler
    forwards it after its pending outputs on the Detokenizer's path (the Detokenizer passes it on to
    `worker`), and sends it on the control path right after fresh stats (the Detokenizer's too)."""

    id: str  # matches the replies
    worker: int = 0  # who asked: both replies go back there
    dp_rank: int = 0  # set by the rank that answers
    path: str = ""  # "output" or "control", set on the way back


class ReleaseHeldReq(_Msg):
    """Test seam (`serving.engine.seams`): let held requests finish; every one when `rids` is empty."""

    rids: list[str] = []


class PauseReq(_Msg):
    """Stop stepping (POST /pause_generation mode in_place): the running and waiting requests keep
    their place and their KV; the loop goes on receiving messages and sending heartbeats."""

    epoch: int  # the Scheduler's stats echo it in `paused` once the pause is in effect


class ContinueReq(_Msg):
    """Step again (POST /continue_generation, or a pause mode other than in_place)."""


class SetLogLevelReq(_Msg):
    """Change the process's root log level (POST /control/log_level)."""

    level: str  # debug | info | warning | error


class AbortReq(_Msg):
    rid: str
    reason: str  # client_disconnect, stop_string, timeout, shutdown, ...
    meta: ReqMeta = msgspec.field(default_factory=ReqMeta)


# -- Scheduler → Detokenizer -----------------------------------------------------------
class Logprobs(msgspec.Struct, kw_only=True, array_like=True):
    """Log-probabilities of a run of tokens, one entry per token: its own, and its top alternatives
    (descending).  `top_ids` and `top_logprobs` hold one list per token, or are empty when no
    alternatives were asked for (logprobs 0)."""

    token_logprobs: list[float]
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


class SpecCounts(msgspec.Struct, array_like=True):
    """One request's speculative decoding so far (`--speculative`): draft tokens proposed and accepted, and the
    engine steps that gave it tokens (its completion tokens are accepted + steps, fewer when a stop ended it
    inside an accepted run)."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0


class TokenOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one rid from one Scheduler step (or its abort / error)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | None = None  # the stop token id that ended it
    error: str | None = None  # why it ended without its answer (finish_reason error, or abort with a cause)
    abort_reason: str | None = None  # with finish_reason "abort": timeout, engine_failure, ...
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, reused from the prefix cache (no prefill computed)
    completion_tokens: int = 0  # generated so far, these included
    retractions: int = 0  # times the engine took it out of the batch (for others' KV) and resumed it
    cpu_ns: int = 0  # its share of the engine steps' CPU time so far (serving.engine.cpu_share)
    speculative: SpecCounts | None = None  # with --speculative, a request speculated: its counts so far
    detok: DetokParams | None = None  # only on the rid's first output
    logprobs: Logprobs | None = None  # of `new_token_ids` (SamplingParams.logprobs set)
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1..n-1, on the first output (prompt_logprobs set)
    meta: ReqMeta = msgspec.field(default_factory=ReqMeta)
    worker: int = 0  # the tokenizer worker the Detokenizer sends it to


class BatchTokenIDOutput(_Msg):
    outputs: list[TokenOut]


class EmbeddingOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The pooled hidden states of one embeddings request, one per input in input order: little-endian float32
    bytes of `dim` values each (not normalised: the front end applies normalisation and `dimensions`)."""

    rid: str
    embeddings: list[bytes]
    dim: int
    prompt_tokens: int = 0  # over every input
    cached_tokens: int = 0  # of those, reused from the prefix cache
    cpu_ns: int = 0
    meta: ReqMeta = msgspec.field(default_factory=ReqMeta)
    worker: int = 0


class BatchEmbeddingOutput(_Msg):
    """Scheduler → Detokenizer → the rids' worker: passed through as it is (there is nothing to decode)."""

    outputs: list[EmbeddingOut]


# -- Detokenizer → TokenizerManager ----------------------------------------------------
class StrOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    rid: str
    text: str  # new text since the previous output for this rid
    output_ids: list[int]  # the tokens behind it (those consumed by the Detokenizer)
    finish_reason: str | None = None
    matched_stop: str | int | None = None  # a stop string (Detokenizer) or stop token id
    abort_in_engine: bool = False  # finished here (stop string) while the Scheduler still runs it
    error: str | None = None
    abort_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    retractions: int = 0
    cpu_ns: int = 0
    speculative: SpecCounts | None = None  # as TokenOut's
    logprobs: Logprobs | None = None  # of `output_ids`
    prompt_logprobs: Logprobs | None = None  # as TokenOut's, passed through on the first output
    meta: ReqMeta = msgspec.field(default_factory=ReqMeta)
    worker: int = 0  # the tokenizer worker it goes to


class BatchStrOutput(_Msg):
    outputs: list[StrOut]


class SpanEventRecord(msgspec.Struct):
    """One event of a forwarded span (a retraction, a wait reason, a decode gap...)."""

    name: str
    time_ns: int  # wall clock, ns since the epoch
    attributes: dict[str, str | int | float | bool | list[str]] = {}


class SpanRecord(msgspec.Struct, kw_only=True):
    """A finished span, forwarded to the main process for /debug/requests and tail sampling (the
    head-sampled ones are exported by their own process)."""

    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str | None = None
    start_ns: int  # wall clock, ns since the epoch
    end_ns: int
    kind: str = "INTERNAL"
    role: str = ""  # process role: main | scheduler | detokenizer
    pid: int = 0
    status: str = "UNSET"  # UNSET | OK | ERROR
    attributes: dict[str, str | int | float | bool | list[str]] = {}
    links: int = 0
    sampled: bool = True  # False: recorded for tail sampling only (exported if the request's end keeps it)
    link_ids: list[str] = []  # "<trace_id>-<span_id>" of each link (a kept trace is exported with them)
    status_message: str = ""
    events: list[SpanEventRecord] = []


class DropCount(msgspec.Struct, array_like=True):
    """One stale-message counter: a message for a rid the component no longer knows."""

    component: str
    message_type: str
    reason: str
    count: int


class DetokenizerStats(_Msg):
    active_rids: int
    stale_drops: list[DropCount] = []  # cumulative since start
    undecodable: int = 0  # cumulative
    spans: list[SpanRecord] = []  # finished since the last stats message
    handling_errors: int = 0  # cumulative: messages, or one rid's output, whose handling raised


# -- Scheduler → TokenizerManager ------------------------------------------------------
class PhaseHistogram(msgspec.Struct, array_like=True):
    """Cumulative histogram of one engine-step phase's durations (or of grammar compiles), in seconds."""

    phase: str  # schedule | forward | sample | grammar | logprobs | output (or compile)
    bounds: list[float]  # upper bounds of the finite buckets
    counts: list[int]  # observations per bucket (not cumulative); one more than bounds: the +Inf bucket
    sum: float


ENGINE_GAP_CAUSES = ("retraction", "paused", "prefill", "scheduler_loop", "batch_size", "slow_step")  # the Scheduler's
DOWNSTREAM_GAP_CAUSES = ("detokenizer", "main_loop", "engine_restart")  # the TokenizerManager's
GAP_CAUSES = ENGINE_GAP_CAUSES + DOWNSTREAM_GAP_CAUSES  # decode gaps


class GapCount(msgspec.Struct, array_like=True):
    """Decode gaps of one cause: one Scheduler rank's (serving.engine.decode_gaps), or a TokenizerManager's
    of the requests of rank `dp_rank` (telemetry.downstream_gaps)."""

    cause: str
    count: int
    dp_rank: int = 0


MISS_REASONS = ("evicted", "never_seen", "too_short")  # prefix-cache misses


class MissCount(msgspec.Struct, array_like=True):
    """Prefix-cache misses one Scheduler rank explained, of one reason (serving.engine.prefix_misses)."""

    reason: str
    count: int


GRAMMAR_CACHE_RESULTS = ("hit", "miss")  # a request's grammar was compiled already (or compiling), or not
GRAMMAR_ERROR_KINDS = ("compile", "dead_end")  # requests a grammar ended with an error


class GrammarCacheCount(msgspec.Struct, array_like=True):
    """Requests with a grammar one Scheduler rank looked up in its compiled-grammar cache, of one result."""

    result: str
    count: int


class GrammarErrorCount(msgspec.Struct, array_like=True):
    """Requests one Scheduler rank ended because of their grammar, of one kind (serving.engine.grammar)."""

    kind: str
    count: int


SPECULATIVE_METHODS = ("ngram", "draft")  # speculative decoding's methods (--speculative, besides off)


class MethodCount(msgspec.Struct, array_like=True):
    """Draft tokens one Scheduler rank's speculative decoding proposed (or accepted) by one method, cumulative."""

    method: str
    count: int


class MethodHistogram(msgspec.Struct, array_like=True):
    """Cumulative histogram of one speculative method's per-request acceptance rates (or tokens per verify)."""

    method: str
    bounds: list[float]
    counts: list[int]  # observations per bucket (not cumulative); one more than bounds: the +Inf bucket
    sum: float


STEP_PHASES = ("prefill", "decode")  # what a step's work is counted under (serving.engine.utilisation)


class PhaseWork(msgspec.Struct, array_like=True):
    """FLOPs or bytes one Scheduler rank's steps asked of the machine in one phase, cumulative (analytic)."""

    phase: str
    count: float


def _no_work() -> list[PhaseWork]:
    return [PhaseWork(p, 0.0) for p in STEP_PHASES]


def _no_gaps() -> list[GapCount]:
    return [GapCount(c, 0) for c in ENGINE_GAP_CAUSES]


class SchedulerStats(_Msg, kw_only=True):
    """Gauges after a step, or a heartbeat when idle; counters are cumulative.

    Built by field name from the `stats()` of what computes each number (`Scheduler.make_stats`);
    a new field needs a default: a rank not heard from yet is exported with them (`EngineMonitor.ranks_or_zero`)."""

    dp_rank: int = 0  # which data-parallel Scheduler rank
    num_running: int
    num_waiting: int
    held: int = 0  # running requests the tests' hold seam holds one token short of their limit
    kv_used: int  # token slots holding K/V (the prefix cache's included)
    kv_reserved: int  # slots running requests hold + what the admission policy expects them to still allocate
    kv_total: int
    kv_in_use: int = 0  # slots running requests hold (private + the cached prefixes they lock); the rest is free
    new_token_ratio: float = 1.0  # the admission estimate's share of remaining output (1 with --admission reserve)
    batch_size: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    step_seconds: float = 0.0
    step_budget_seconds: float = 0.0  # the latest step's time budget for decodes plus prefill (0: none applied)
    prefill_budget_tokens: int = 0  # the prompt tokens the latest step could prefill (every cap and floor applied)
    steps_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    last_token_at: int | None = None  # monotonic ns of the latest sampled token
    stale_drops: list[DropCount] = []
    undecodable: int = 0
    prefill_tokens_total: int = 0
    spans: list[SpanRecord] = []  # finished since the last stats message
    handling_errors: int = 0  # cumulative: messages, or one rid's output, whose handling raised
    step_phases: list[PhaseHistogram] = []  # cumulative: where engine steps spent their time
    prefix_cached_tokens: int = 0  # KV slots the prefix cache holds (part of kv_used)
    prefix_queries_tokens_total: int = 0  # cumulative: prompt tokens of admitted requests
    prefix_hits_tokens_total: int = 0  # cumulative: of those, reused from the prefix cache
    prefix_evicted_tokens_total: int = 0  # cumulative: cached slots evicted to make room
    prefix_evictable_tokens: int = 0  # cached slots no running request locks (free to evict; part of kv_used)
    paused: int = 0  # the epoch of the PauseReq in effect (no step runs); 0 while stepping (`Scheduler.pause_epoch`)
    retractions_total: int = 0  # cumulative: requests taken out of the batch because KV ran out
    retracted_tokens_total: int = 0  # cumulative: the K/V positions they had
    retraction_recomputed_tokens_total: int = 0  # cumulative: of those, computed again when they resumed
    admissions_total: int = 0  # cumulative: requests admitted into the batch (resumptions included)
    queue_head_age_seconds: float = 0.0  # how long the oldest waiting request has waited (0: none waits)
    queue_head_fits: bool = False  # the next request to admit has KV and batch room now (False while paused)
    kv_events_published_total: int = 0  # cumulative: KV-cache events sent (--kv-events-endpoint)
    kv_events_dropped_total: int = 0  # cumulative: KV-cache events of batches a full queue or subscriber refused
    decode_gaps: list[GapCount] = msgspec.field(default_factory=_no_gaps)  # cumulative, every cause
    prefix_misses: list[MissCount] = msgspec.field(default_factory=lambda: [MissCount(r, 0) for r in MISS_REASONS])
    grammar_compile_seconds: list[PhaseHistogram] = []  # cumulative: cold grammar compiles (phase "compile")
    grammar_cache: list[GrammarCacheCount] = msgspec.field(
        default_factory=lambda: [GrammarCacheCount(r, 0) for r in GRAMMAR_CACHE_RESULTS]
    )
    grammar_forced_tokens_total: int = 0  # cumulative: tokens sampled from a grammar mask that allowed only them
    grammar_errors: list[GrammarErrorCount] = msgspec.field(
        default_factory=lambda: [GrammarErrorCount(k, 0) for k in GRAMMAR_ERROR_KINDS]
    )
    work_flops: list[PhaseWork] = msgspec.field(default_factory=_no_work)  # cumulative: the steps' FLOPs by phase
    work_bytes: list[PhaseWork] = msgspec.field(default_factory=_no_work)  # cumulative: bytes they moved, by phase
    speculative_proposed: list[MethodCount] = msgspec.field(  # cumulative: draft tokens proposed, by method
        default_factory=lambda: [MethodCount(m, 0) for m in SPECULATIVE_METHODS]
    )
    speculative_accepted: list[MethodCount] = msgspec.field(  # cumulative: of those, accepted by the target model
        default_factory=lambda: [MethodCount(m, 0) for m in SPECULATIVE_METHODS]
    )
    speculative_acceptance: list[MethodHistogram] = []  # cumulative: finished requests' acceptance rates
    speculative_step_tokens: list[MethodHistogram] = []  # cumulative: tokens a request got from one verify step
    peak_flops: float = 0.0  # FLOP/s the startup probe measured (0: not measured, --no-peak-probe)
    peak_bytes_per_second: float = 0.0  # memory-copy bandwidth the startup probe measured (0: not measured)

    @property
    def kv_usage_ratio(self) -> float:
        """Committed KV slots ÷ total: the admission policy's headroom, above 1 when running requests outgrow
        the estimate (derived, not on the wire)."""
        return self.kv_reserved / self.kv_total if self.kv_total else 0.0

    @property
    def kv_in_use_ratio(self) -> float:
        """Slots running requests hold ÷ total; evictable cache counts as free (derived, not on the wire)."""
        return self.kv_in_use / self.kv_total if self.kv_total else 0.0


class FlushCacheReqOutput(_Msg):
    id: str  # the FlushCacheReq's
    success: bool
    message: str = ""
    flushed_tokens: int = 0  # KV slots the flush freed
    worker: int = 0  # the FlushCacheReq's
    dp_rank: int = 0


class StartupPhase(msgspec.Struct, array_like=True):
    """How long one phase of a process's latest start took (`serving.startup_phases`)."""

    role: str  # main | scheduler (scheduler_dp<N> with several ranks) | detokenizer
    phase: str  # imports | model_resolve | native_kernels | weight_load | kv_pool | tokenizer_load...
    seconds: float


class StartupProgress(_Msg, kw_only=True):
    """A child still starting → the supervisor: it has begun `phase` (what /health says while not ready)."""

    role: str
    pid: int
    phase: str


class Ready(_Msg, kw_only=True):
    """A child process is up; the Scheduler also says what the TM must validate against."""

    role: str  # scheduler | detokenizer
    pid: int
    dp_rank: int = 0  # the Scheduler's data-parallel rank
    model_name: str = ""
    architecture: str = ""  # the registered architecture served, e.g. Qwen3ForCausalLM
    sliding_window: int = 0  # 0: full attention
    context_len: int = 0
    vocab_size: int = 0
    dtype: str = ""  # what the Scheduler computes in (float32 | bfloat16)
    quantization: str = ""  # none | int8
    kv_total: int = 0
    pooling: str = ""  # the embeddings it serves (last | mean | cls); "" none: POST /v1/embeddings is refused
    embedding_only: bool = False  # an embedding model: generation is refused
    normalize: bool = True  # the model's default L2 normalisation of embeddings
    hidden_size: int = 0  # the embeddings' dimension
    encoder: bool = False  # an encoder (BERT): truncation keeps an input's head and its last ([SEP]) token
    startup_phases: list[StartupPhase] = []  # how its start went, phase by phase


# -- the hub and its tokenizer workers ----------------------------------------------------
class WorkerGone(_Msg):
    """Hub → every Scheduler rank and the Detokenizer: this worker died; free its rids, quietly."""

    worker: int


class EngineStatus(_Msg):
    """Hub → worker, on every change and each heartbeat: what the worker validates and answers /health with."""

    generation: int  # bumped at each engine failure: a worker seeing a new one ends its in-flight requests
    ready: list[Ready] = []  # every child's Ready once all are ready, else empty
    unavailable: str | None = None  # why the engine cannot take requests (starting, failed, down...)
    failure: str | None = None  # with a new generation: the failure that ended the in-flight requests
    throughput: float = 0.0  # tokens/s over all ranks (admission's drain-rate estimate)
    last_token_at: int | None = None  # monotonic ns, the latest over all ranks
    down_at: int | None = None  # monotonic ns when the restart budget was spent (the engine stays down)
    paused: str | None = None  # the pause mode an operator set (POST /pause_generation), None when serving


class WorkerStats(_Msg):
    """Worker → hub, each heartbeat: what the watchdog and /debug/state need from it."""

    worker: int
    pid: int
    in_flight: int
    oldest_arrival: int | None = None
    stale_drops: list[DropCount] = []  # the TokenizerManager's, cumulative
    undecodable: int = 0
    handling_errors: int = 0
    decode_gaps: list[GapCount] = []  # the TokenizerManager's (downstream causes), cumulative
    tail_kept: list[str] = []  # trace ids whose tail-sampling decision since the last one was: export
    tail_dropped: list[str] = []  # ... and: drop (the hub holds their engine spans)


class Exemplar(msgspec.Struct, array_like=True):
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


class MetricSample(msgspec.Struct, array_like=True):
    name: str
    labels: dict[str, str]
    value: float
    exemplar: Exemplar | None = None


class MetricFamily(msgspec.Struct, array_like=True):
    """One family of a worker's registry, as `prometheus_client` collects it."""

    name: str
    type: str  # counter | gauge | histogram | ...
    help: str
    samples: list[MetricSample]


class SnapshotReq(_Msg):
    """Hub → worker: send your metrics (`kind` metrics), the timeline entry of rid `arg` (`kind` request),
    your requests (`kind` requests), or apply the control order `arg` and say what you did (`kind` control)."""

    id: str
    kind: str
    arg: str = ""


class Snapshot(_Msg):
    id: str
    worker: int
    families: list[MetricFamily] = []
    entry: bytes = b""  # JSON of a timeline entry; empty when the worker does not hold it


class HubQuery(_Msg):
    """Worker → hub: an answer only the hub can give, over every worker (metrics, debug_state, request,
    requests, control: an operator action to apply everywhere)."""

    id: str
    worker: int
    kind: str
    arg: str = ""


class StepRecord(msgspec.Struct, array_like=True):
    """One engine step, as the step timeline keeps it (monotonic ns; durations in ns)."""

    start: int
    end: int
    schedule: int
    forward: int
    sample: int
    output: int
    num_decode: int
    prefill_tokens: int
    retracted: int
    rids: list[str]  # decodes first, then the prefill chunks
    prefill_rids: list[str]
    trace_ids: list[str]  # per rid, "" when not traced
    logprobs: int = 0  # log-probabilities of sampled and prompt tokens (outside `sample`)
    grammar: int = 0  # grammar masks filled and applied, sampled tokens consumed (outside `sample`)
    verify: int = 0  # speculative drafts judged by the acceptance rule (outside `sample`)


class StepTimelineOutput(_Msg):
    id: str  # the StepTimelineReq's
    worker: int = 0  # the StepTimelineReq's
    dp_rank: int = 0
    steps: list[StepRecord] = []


class HubReply(_Msg):
    id: str
    status: int = 200
    body: bytes = b""  # JSON, or the metrics exposition in the format `arg` asked for


Message = Union[
    TokenizedGenerateReqInput,
    AbortReq,
    FlushCacheReq,
    PauseReq,
    ContinueReq,
    SetLogLevelReq,
    BatchTokenIDOutput,
    BatchStrOutput,
    TokenizedEmbeddingReqInput,
    BatchEmbeddingOutput,
    DetokenizerStats,
    SchedulerStats,
    FlushCacheReqOutput,
    Ready,
    WorkerGone,
    EngineStatus,
    WorkerStats,
    SnapshotReq,
    Snapshot,
    HubQuery,
    HubReply,
    StepTimelineReq,
    StepTimelineOutput,
    BarrierReq,
    ReleaseHeldReq,
    StartupProgress,
]
