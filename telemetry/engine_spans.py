"""The Scheduler's and the Detokenizer's spans, parented by each rid's carrier.

Scheduler: `receive scheduler` (CONSUMER), `queue` (one per waiting interval: a retracted
request waits again, and that `queue` span opens with a `retracted` event saying what it
had and what the prefix cache kept, and a `wait_reason` event each time the reason it
was not admitted changed, serving.engine.wait_reasons, and an `admitted` or `resumed` event
where it ends in an admission; with a structured output, the first says what its grammar cost:
`sightline.grammar.*`, serving.engine.grammar), one `prefill` per chunk (the first says why the prefix cache
matched no more: `sightline.prefix_cache.*`, serving.engine.prefix_misses; with prompt logprobs
asked, `sightline.prompt_tokens_scored` and `sightline.prompt_tokens_cached`), `decode` (a `decode_gap` event per
long inter-token gap, serving.engine.decode_gaps, a `speculative_verify` event per verify step of a speculated
request with its proposed and accepted draft tokens, and a `finished` event),
`send detokenizer` (PRODUCER, first output) — all in the rid's trace — and one
`forward` span per engine step in its own trace, linked to every sampled rid in the
batch.  Detokenizer: `receive detokenizer` (CONSUMER) and `send tokenizer_manager`
(PRODUCER) for the first output, and `detokenize` over the rid's life there.
Stage spans are recorded when the rid finishes, from the engine's own stamps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, get_current_span

from protocol.io_struct import Logprobs, ReqMeta
from telemetry.tracing import PRODUCER_KEY, Tracing, hop_attributes, traceparent_of


class EngineRetraction(Protocol):
    at: int
    computed: int
    cached: int
    output_tokens: int
    reason: str


class WaitLedger(Protocol):
    ns: dict[str, int]
    changes: list[tuple[int, str]]  # (at, reason)


class EngineTimes(Protocol):
    queued: int
    wait: WaitLedger
    scheduled: int | None
    waits: list[tuple[int, int]]
    retractions: list  # of EngineRetraction
    first_token: int | None
    finished: int | None
    prefill_chunks: list[tuple[int, int, int]]  # (start, end, tokens)
    token_times: list[int]
    gaps: list  # of DecodeGap (serving.engine.decode_gaps)


class PrefixMissInfo(Protocol):
    def attributes(self) -> dict[str, str | int]: ...


class GrammarInfo(Protocol):
    def attributes(self) -> dict[str, str | float | bool]: ...


class SpecRuns(Protocol):
    runs: list[tuple[int, int, int]]  # (first output token index, proposed, accepted) per verify step


class EngineRequest(Protocol):
    """What the stage spans read from an engine request (`serving.engine.request.Req`)."""

    rid: str
    times: EngineTimes
    output_ids: list[int]
    cached_tokens: int  # prompt tokens reused from the prefix cache
    prefix_miss: PrefixMissInfo | None  # why the cache matched no more (serving.engine.prefix_misses)
    prompt_logprobs: Logprobs | None  # prompt logprobs asked: the entries scored
    prompt_cache_held: int  # prompt positions the prefix cache held at admission
    grammar: GrammarInfo | None  # its structured output's grammar (serving.engine.grammar)
    spec: SpecRuns | None  # speculated: its verify steps (serving.engine.speculation)

    @property
    def prompt_len(self) -> int: ...


class _Producers:
    """PRODUCER spans started before a batch is encoded, ended once it is sent."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self.pending: list[Span] = []

    def start(self, ctx: Context | None, rid: str, destination: str, message_type: str, meta: ReqMeta) -> None:
        if ctx is None:
            return
        span = self.tracing.start(
            f"send {destination}",
            ctx,
            kind=SpanKind.PRODUCER,
            attributes={"sightline.rid": rid, **hop_attributes(destination, message_type, "send")},
        )
        meta.trace = {**meta.trace, PRODUCER_KEY: traceparent_of(span) or ""}
        self.pending.append(span)

    def sent(self) -> None:
        for span in self.pending:
            span.end()
        self.pending = []


class SchedulerSpans:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self.ctx: dict[str, Context] = {}
        self.producers = _Producers(tracing)

    def received(self, rid: str, meta: ReqMeta, recv: int, done: int) -> None:
        ctx = self.tracing.extract(meta.trace)
        if ctx is None:
            return
        self.ctx[rid] = ctx
        self.tracing.record(
            "receive scheduler",
            ctx,
            recv,
            done,
            kind=SpanKind.CONSUMER,
            links=self.tracing.link_of(meta.trace),
            attributes={"sightline.rid": rid, **hop_attributes("scheduler", "TokenizedGenerateReqInput", "process")},
        )

    def first_output(self, rid: str, meta: ReqMeta) -> None:
        self.producers.start(self.ctx.get(rid), rid, "detokenizer", "BatchTokenIDOutput", meta)

    def forget(self, rid: str) -> None:
        """The rid ended without an engine record to draw its spans from (its queue message was bad)."""
        self.ctx.pop(rid, None)

    def forward(self, rids: list[str], start: int, end: int, attributes: dict) -> None:
        links = [Link(get_current_span(c).get_span_context()) for r in rids if (c := self.ctx.get(r)) is not None]
        if links:
            self.tracing.record("forward", Context(), start, end, links=links, attributes=attributes)

    def finished(
        self, req: EngineRequest, reason: str, error_type: str | None = None, message: str | None = None
    ) -> None:
        """Record the rid's stage spans; `error_type` (abort reason, engine_error) marks them failed."""
        ctx = self.ctx.pop(req.rid, None)
        if ctx is None:
            return
        t, rid = req.times, req.rid
        err = error_type if reason not in ("stop", "length") else None
        base = {"sightline.rid": rid}
        waits = t.waits or [(t.queued, t.finished or t.queued)]
        grammar = req.grammar.attributes() if req.grammar is not None else {}
        for i, (start, end) in enumerate(waits):  # the first wait, then one after each retraction
            after = t.retractions[i - 1 : i] if i else []
            reasons = [
                ("wait_reason", at, {"sightline.wait.reason": r}) for at, r in t.wait.changes if start <= at < end
            ]
            if end != t.finished:  # it was admitted at the end of this wait (not ended in the queue)
                reasons.append(("resumed" if i else "admitted", end, {"sightline.queue.after_retractions": i}))
            self.tracing.record(
                "queue",
                ctx,
                start,
                end,
                attributes={
                    **base,
                    "sightline.queue_seconds": (end - start) / 1e9,
                    "sightline.queue.after_retractions": i,
                    **(grammar if i == 0 else {}),
                },
                error=err if t.scheduled is None else None,
                events=[retraction_event(r) for r in after] + reasons,
            )
        miss = req.prefix_miss.attributes() if req.prefix_miss is not None else {}
        if req.prompt_logprobs is not None:  # scoring recomputes what the cache held: what that cost
            miss = {
                **miss,
                "sightline.prompt_tokens_scored": len(req.prompt_logprobs.token_logprobs),
                "sightline.prompt_tokens_cached": req.prompt_cache_held,
            }
        for i, (start, end, n) in enumerate(t.prefill_chunks):
            self.tracing.record(
                "prefill",
                ctx,
                start,
                end,
                attributes={
                    **base,
                    "sightline.prefill.chunk": i,
                    "sightline.prefill.tokens": n,
                    "gen_ai.usage.input_tokens": req.prompt_len,
                    "gen_ai.usage.cache_read.input_tokens": req.cached_tokens,
                    **(miss if i == 0 else {}),
                },
            )
        if t.first_token is not None and t.finished is not None:
            n = len(req.output_ids)
            mean_itl = (t.token_times[-1] - t.first_token) / 1e9 / (n - 1) if n > 1 else 0.0
            self.tracing.record(
                "decode",
                ctx,
                t.first_token,
                t.finished,
                attributes={
                    **base,
                    "gen_ai.usage.output_tokens": n,
                    "sightline.decode.mean_itl_seconds": mean_itl,
                    "gen_ai.response.finish_reasons": [reason],
                    "sightline.retractions": len(t.retractions),
                },
                error=err,
                error_message=message,
                events=[gap_event(g) for g in t.gaps]
                + spec_events(req)
                + [("finished", t.finished, {"gen_ai.response.finish_reasons": [reason]})],
            )


def retraction_event(r: EngineRetraction) -> tuple[str, int, dict]:
    """The `retracted` span event: what the request had, what the cache kept of it, and why."""
    return (
        "retracted",
        r.at,
        {
            "sightline.retraction.reason": r.reason,
            "sightline.retraction.computed_tokens": r.computed,
            "sightline.retraction.cached_tokens": r.cached,
            "sightline.retraction.discarded_tokens": r.computed - r.cached,
            "sightline.retraction.output_tokens": r.output_tokens,
        },
    )


def spec_events(req: EngineRequest) -> list[tuple[str, int, dict]]:
    """A `speculative_verify` event per recorded verify step, at its first token's time: where its accepted run
    of draft tokens landed on the token timeline."""
    if req.spec is None:
        return []
    times, end = req.times.token_times, req.times.finished or 0
    return [
        (
            "speculative_verify",
            times[i] if i < len(times) else end,  # none of its tokens kept: the request ended first
            {
                "sightline.speculative.token_index": i,
                "sightline.speculative.proposed": proposed,
                "sightline.speculative.accepted": accepted,
            },
        )
        for i, proposed, accepted in req.spec.runs
    ]


def gap_event(g) -> tuple[str, int, dict]:
    """The `decode_gap` span event (at the token that ended the gap): how long, why, and who caused it."""
    return (
        "decode_gap",
        g.end,
        {
            "sightline.decode_gap.seconds": g.seconds,
            "sightline.decode_gap.cause": g.cause,
            "sightline.decode_gap.culprit_rids": list(g.culprits),
            "sightline.decode_gap.prefill_tokens": g.prefill_tokens,
            "sightline.decode_gap.batch_size": g.batch_size,
            "sightline.decode_gap.steps": g.steps,
        },
    )


@dataclass
class _DetokRid:
    ctx: Context
    first_recv: int
    busy_ns: int = 0
    outputs: int = 0


class DetokSpans:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self.rids: dict[str, _DetokRid] = {}
        self.producers = _Producers(tracing)

    def output(self, rid: str, meta: ReqMeta, recv: int, done: int, first: bool) -> None:
        if first:
            ctx = self.tracing.extract(meta.trace)
            if ctx is None:
                return
            self.rids[rid] = _DetokRid(ctx, recv)
            self.tracing.record(
                "receive detokenizer",
                ctx,
                recv,
                done,
                kind=SpanKind.CONSUMER,
                links=self.tracing.link_of(meta.trace),
                attributes={"sightline.rid": rid, **hop_attributes("detokenizer", "BatchTokenIDOutput", "process")},
            )
            self.producers.start(ctx, rid, "tokenizer_manager", "BatchStrOutput", meta)
        st = self.rids.get(rid)
        if st is not None:
            st.busy_ns += done - recv
            st.outputs += 1

    def finished(self, rid: str, done: int, reason: str | None) -> None:
        st = self.rids.pop(rid, None)
        if st is not None:
            self.tracing.record(
                "detokenize",
                st.ctx,
                st.first_recv,
                done,
                attributes={
                    "sightline.rid": rid,
                    "sightline.detokenize.busy_seconds": st.busy_ns / 1e9,
                    "sightline.detokenize.outputs": st.outputs,
                    "gen_ai.response.finish_reasons": [reason or "abort"],
                },
            )
