"""The Scheduler process's side of each request beside the engine's `Req`: one `Envelope` per rid (its
trace carrier and stamps, the tokenizer worker its outputs go to, the Detokenizer's parameters sent with
its first output), and the outputs built from the engine's events (`emit`) into the outbox.

Every ending goes through `forget` (finish, abort, engine error, timeout, a worker gone, an output that
could not be built): the envelope, the CPU ledger entry and the stage-span context go in this one place,
and the ending is remembered to attribute late messages for the rid (stale drops).  An embeddings
request's inputs are `EmbedGroups`'; what ends one comes back here to be sent and forgotten the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from protocol.io_struct import DetokParams, ReqMeta, TokenizedGenerateReqInput, TokenOut
from protocol.reasons import ENGINE_ERROR, FinishReason
from serving.engine.cpu_share import CpuLedger
from serving.engine.embed_groups import EmbedGroups
from serving.engine.events import TokenEvent, end_with_error
from serving.engine.request import Req
from serving.engine.scheduler_core import SchedulerCore
from serving.ipc import DropCounter
from serving.ratelog import RateLimitedLog
from telemetry.engine_spans import SchedulerSpans
from telemetry.step_timeline import trace_id_of

log = logging.getLogger(__name__)


@dataclass
class Envelope:
    """What the Scheduler process keeps of one generation request while the engine runs it."""

    meta: ReqMeta  # its trace carrier and stamps, updated and sent with every output
    worker: int  # the tokenizer worker its outputs go back to
    detok: DetokParams | None  # sent with its first output (then None)
    trace_id: str = ""  # for the step timeline's flows ("" when untraced or the timeline is off)


class Outputs:
    def __init__(
        self,
        core: SchedulerCore,
        spans: SchedulerSpans,
        cpu: CpuLedger,
        drops: DropCounter,
        embeds: EmbedGroups,
        errors: RateLimitedLog,
        timeline: bool,
    ) -> None:
        self.core, self.spans, self.cpu, self.drops, self.embeds, self.errors = core, spans, cpu, drops, embeds, errors
        self.timeline = timeline  # keep trace ids for the step timeline
        self.reqs: dict[str, Envelope] = {}
        self.outbox: list[TokenOut] = []

    def opened(self, msg: TokenizedGenerateReqInput) -> None:
        """The engine queued `msg`'s request."""
        trace = trace_id_of(msg.meta.trace) if self.timeline and msg.meta.trace else ""
        self.reqs[msg.rid] = Envelope(msg.meta, msg.worker, msg.detok, trace)

    def refused(self, msg: TokenizedGenerateReqInput, error: str) -> None:
        """The engine could not queue `msg`'s request: it ends at once with `error`."""
        self.outbox.append(
            TokenOut(
                rid=msg.rid,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=error,
                prompt_tokens=len(msg.input_ids),
                detok=msg.detok,
                meta=msg.meta,
                worker=msg.worker,
            )
        )

    def trace_ids(self, rids: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(e.trace_id if (e := self.reqs.get(r)) is not None else "" for r in rids)

    def rids_of(self, worker: int) -> list[str]:
        return [rid for rid, e in self.reqs.items() if e.worker == worker]

    def embedding_ended(self, out: TokenOut | None) -> None:
        """An embeddings request ended without its vectors (`out`, its answer): sent, and its rid forgotten."""
        if out is not None:
            self.outbox.append(out)
            self.drops.forget(out.rid, out.finish_reason)

    def emit(self, ev: TokenEvent | None, error_type: str | None = None, error: str | None = None) -> None:
        """Queue the rid's output; if building it fails, end that rid alone with an explicit error."""
        if ev is None:
            return
        if self.embeds.owns(ev.rid):  # an embeddings request's input
            self.embedding_ended(self.embeds.take(ev, error_type, error))
            return
        try:
            self.outbox.append(self._token_out(ev, error_type, error))
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"could not build the output of request {ev.rid[:64]!r}; ending it", exc)
            self.core.abort(ev.rid)  # None when it had already finished
            env = self.reqs.get(ev.rid)
            self.outbox.append(
                TokenOut(
                    rid=ev.rid,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    error="internal engine error",
                    detok=(env.detok if env else None) or DetokParams(),
                    worker=env.worker if env else 0,
                )
            )
            self.forget(ev.rid, FinishReason.ERROR, ev.req, FinishReason.ERROR, ENGINE_ERROR, "internal engine error")

    def _token_out(self, ev: TokenEvent, error_type: str | None, error: str | None) -> TokenOut:
        req: Req = ev.req
        env = self.reqs[ev.rid]
        meta = env.meta
        st, t = meta.stamps, req.times
        st.scheduled, st.first_token, st.finished = t.scheduled, t.first_token, t.finished
        if t.scheduled is not None:
            st.waited = t.waited_ns(t.finished)
            if ev.finished:
                st.wait_reasons = dict(t.wait.ns)
        if t.token_times:
            st.last_token = t.token_times[-1]
        detok, env.detok = env.detok, None
        out = TokenOut(
            rid=ev.rid,
            new_token_ids=ev.new_token_ids,
            finish_reason=ev.finish_reason.value if ev.finish_reason else None,
            matched_stop=req.matched_stop,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
            retractions=req.num_retractions,
            cpu_ns=self.cpu.of(ev.rid, ev.finished),
            speculative=msgspec.structs.replace(req.spec.counts) if req.spec is not None else None,
            detok=detok,
            meta=meta,
            worker=env.worker,
            logprobs=ev.logprobs,
        )
        if out.detok is not None:
            self.spans.first_output(ev.rid, meta)
            if req.prompt_logprobs is not None and req.score_from is None:  # every prompt token scored
                out.prompt_logprobs = req.prompt_logprobs
        if error is not None:  # an engine error, or an abort with a cause the client must hear (timeout)
            end_with_error(out, error_type, error)
        if ev.finished:
            self.forget(ev.rid, out.finish_reason, req, out.finish_reason, error_type, error)
        return out

    def forget(
        self,
        rid: str,
        ending: str,
        req: Req | None,
        outcome: str | None = None,
        error_type: str | None = None,
        error: str | None = None,
    ) -> None:
        """The rid ended here (`ending`, what a late message for it is then attributed to): every per-request
        table of this process emptied in this one place, whichever way it ended; its stage spans recorded
        (`outcome`, failed with `error_type`) when the engine's record of it is at hand."""
        self.reqs.pop(rid, None)
        self.cpu.of(rid, done=True)
        self.drops.forget(rid, ending)
        if req is not None:
            self.spans.finished(req, outcome or ending, error_type, error)
        else:
            self.spans.forget(rid)
