"""The Scheduler's side of embeddings requests: one engine request per input, one answer per request.

A `TokenizedEmbeddingReqInput` of N inputs becomes N prefill-only engine requests, rids
`<rid>/<i>` (`serving.engine.embedding`), queued and batched with generation like any prompt.
When the last one has run, one `EmbeddingOut` carries every pooled vector, in input order,
to the Detokenizer (which passes it through).  If any input fails or is aborted (a timeout in
the queue, the client gone) the others are aborted and the request ends with one `TokenOut`
carrying the error, as a generation request does.

It holds the engine core, the stage spans, the CPU ledger and the error log it needs, not the
Scheduler: the `TokenOut` that ends a request is returned, and the Scheduler sends it and
forgets the rid as it does a generation request's.

The request's stamps are its inputs': `scheduled` the first admission, `waited` the longest
input's time in the queue, `first_token` and `finished` when the last input's pooling was done.
Each input records its own `queue` and `prefill` spans in the request's trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.io_struct import DetokParams, EmbeddingOut, TokenizedEmbeddingReqInput, TokenOut
from protocol.reasons import AbortReason, FinishReason
from protocol.sampling_params import SamplingParams
from serving.engine.cpu_share import CpuLedger
from serving.engine.events import TokenEvent, end_with_error
from serving.engine.scheduler_core import SchedulerCore
from serving.ratelog import RateLimitedLog
from telemetry.engine_spans import SchedulerSpans


@dataclass
class EmbedGroup:
    msg: TokenizedEmbeddingReqInput
    subs: list[str]
    vectors: dict[int, bytes] = field(default_factory=dict)
    cached_tokens: int = 0
    cpu_ns: int = 0
    scheduled: int | None = None
    waited: int = 0
    wait_reasons: dict[str, int] = field(default_factory=dict)
    finished: int | None = None
    dim: int = 0


class EmbedGroups:
    def __init__(self, core: SchedulerCore, spans: SchedulerSpans, cpu: CpuLedger, errors: RateLimitedLog) -> None:
        self.core, self.spans, self.cpu, self.errors = core, spans, cpu, errors
        self.groups: dict[str, EmbedGroup] = {}
        self.parent: dict[str, tuple[str, int]] = {}  # input rid -> (request rid, index)
        self.outbox: list[EmbeddingOut] = []
        self.requests_total = 0
        self.inputs_total = 0

    def add(self, msg: TokenizedEmbeddingReqInput, now: int) -> TokenOut | None:
        """Queue every input; the request's error answer if it could not be queued (None: queued)."""
        core = self.core
        msg.meta.stamps.sched_recv = now
        subs = [f"{msg.rid}/{i}" for i in range(len(msg.inputs))]
        i = 0
        try:
            if msg.rid in self.groups or not msg.inputs:
                raise ValueError("duplicate request id" if msg.inputs else "no input")
            for i, (sub, ids) in enumerate(zip(subs, msg.inputs)):
                req = core.add_request(
                    sub, ids, SamplingParams(max_new_tokens=1), msg.priority, msg.cache_namespace, pooling=msg.pooling
                )
                req.times.queued = req.times.waiting_since = now
                self.parent[sub] = (msg.rid, i)
        except Exception as exc:  # noqa: BLE001 - a client error (ValueError) or the engine's: this request alone
            if not isinstance(exc, ValueError):
                self.errors.report(f"could not queue embeddings request {msg.rid[:64]!r}", exc)
            for sub in subs:
                if self.parent.pop(sub, None) is not None:
                    core.abort(sub)
            error = f"input {i}: {exc}" if isinstance(exc, ValueError) else "the engine could not queue this request"
            return TokenOut(
                rid=msg.rid,
                new_token_ids=[],
                finish_reason="error",
                error=error,
                prompt_tokens=sum(map(len, msg.inputs)),
                detok=DetokParams(),
                meta=msg.meta,
                worker=msg.worker,
            )
        self.groups[msg.rid] = EmbedGroup(msg, subs)
        self.requests_total += 1
        self.inputs_total += len(subs)
        self.spans.received(msg.rid, msg.meta, now, now)
        ctx = self.spans.ctx.get(msg.rid)
        if ctx is not None:  # each input's stage spans go in the request's trace
            for sub in subs:
                self.spans.ctx[sub] = ctx
        return None

    def owns(self, rid: str) -> bool:
        """`rid` is one of these requests' inputs (an engine rid), not a generation request's."""
        return rid in self.parent

    def take(self, ev: TokenEvent, error_type: str | None, error: str | None) -> TokenOut | None:
        """The event of an input (`owns(ev.rid)`); the request's error answer when this input ended it."""
        rid, i = self.parent.pop(ev.rid)
        g = self.groups.get(rid)
        req = ev.req
        self.spans.finished(req, ev.finish_reason.value if ev.finish_reason else "abort", error_type, error)
        if g is None:
            return None
        t = req.times
        g.cpu_ns += self.cpu.of(ev.rid, True)
        if t.scheduled is not None:
            g.scheduled = t.scheduled if g.scheduled is None else min(g.scheduled, t.scheduled)
            waited = t.waited_ns(t.finished)
            if waited >= g.waited:  # the request's queue time and its reasons are its longest-waiting input's
                g.waited, g.wait_reasons = waited, dict(t.wait.ns)
        g.cached_tokens += req.cached_tokens
        g.finished = t.finished
        if ev.finish_reason is FinishReason.STOP and error is None and req.embedding is not None:
            vec = req.embedding.numpy().astype("<f4", copy=False)
            g.vectors[i], g.dim = vec.tobytes(), int(vec.shape[0])
            if len(g.vectors) == len(g.subs):
                self._done(g)
            return None
        return self._fail(g, ev, error_type, error)

    def _stamp(self, g: EmbedGroup) -> None:
        st = g.msg.meta.stamps
        st.scheduled, st.finished, st.first_token = g.scheduled, g.finished, g.finished
        st.waited = g.waited if g.scheduled is not None else None
        st.wait_reasons = g.wait_reasons or None
        if g.finished is not None:
            st.last_token = g.finished

    def _done(self, g: EmbedGroup) -> None:
        del self.groups[g.msg.rid]
        self._stamp(g)
        meta = g.msg.meta
        self.spans.first_output(g.msg.rid, meta)
        self.spans.ctx.pop(g.msg.rid, None)
        self.outbox.append(
            EmbeddingOut(
                rid=g.msg.rid,
                embeddings=[g.vectors[i] for i in range(len(g.subs))],
                dim=g.dim,
                prompt_tokens=sum(map(len, g.msg.inputs)),
                cached_tokens=g.cached_tokens,
                cpu_ns=g.cpu_ns,
                meta=meta,
                worker=g.msg.worker,
            )
        )

    def _fail(self, g: EmbedGroup, ev: TokenEvent, error_type: str | None, error: str | None) -> TokenOut:
        """One input ended without its embedding: abort the others; the request's answer carries the cause."""
        del self.groups[g.msg.rid]
        for sub in g.subs:
            if sub in self.parent:
                self.parent.pop(sub)
                other = self.core.abort(sub)
                if other is not None:
                    self.spans.finished(other.req, "abort", error_type, error)
                    self.cpu.of(sub, True)
        self._stamp(g)
        self.spans.ctx.pop(g.msg.rid, None)
        reason = ev.finish_reason.value if ev.finish_reason else "abort"
        out = TokenOut(
            rid=g.msg.rid,
            new_token_ids=[],
            finish_reason=reason,
            error=error,
            prompt_tokens=sum(map(len, g.msg.inputs)),
            cached_tokens=g.cached_tokens,
            cpu_ns=g.cpu_ns,
            detok=DetokParams(),
            meta=g.msg.meta,
            worker=g.msg.worker,
        )
        if error is not None:
            end_with_error(out, error_type, error)
        elif ev.error is not None:
            out.finish_reason, out.error = "error", ev.error
        return out

    def abort(self, rid: str, reason: str) -> TokenOut | None:
        """An AbortReq for a request rid in `groups`; the request's answer if the abort ended it."""
        g = self.groups[rid]
        sub = next((s for s in g.subs if s in self.parent), None)
        ev = self.core.abort(sub) if sub is not None else None
        return self.take(ev, reason, None) if ev is not None else None

    def worker_gone(self, worker: int) -> None:
        for rid in [r for r, g in self.groups.items() if g.msg.worker == worker]:
            g = self.groups.pop(rid)
            for sub in g.subs:
                if self.parent.pop(sub, None) is not None:
                    ev = self.core.abort(sub)
                    if ev is not None:
                        self.spans.finished(ev.req, "abort", AbortReason.WORKER_GONE, None)
                    self.cpu.of(sub, True)
            self.spans.ctx.pop(rid, None)
