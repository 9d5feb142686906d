"""The Detokenizer process: token ids in, text deltas out, one `DetokReq` per rid.

A rid's record is created by its first output (which carries its `DetokParams`) and
dropped (`forget`, the one place) when its final output from the Scheduler arrives.  A stop
string ends the request here first: the TokenizerManager is told (`abort_in_engine=True`)
and aborts it in the Scheduler; tokens the Scheduler produced past the stop are discarded
on purpose until its final output arrives.  Any other output for a rid with no record is
stale: dropped and counted.

One rid's output that cannot be decoded (token ids outside the vocabulary, say) ends
that rid alone: its client gets finish_reason "error" (with `abort_in_engine=True` when
the Scheduler still runs it, so the TokenizerManager aborts it there) and the rest of
its outputs are discarded quietly.  A message whose handling fails as a whole is
dropped.  Both are counted (`DetokenizerStats.handling_errors`) and logged at most once
a second; neither stops the process.

Outputs go to the tokenizer worker that holds the rid (`TokenOut.worker`), one PUSH
socket per worker, opened on first use; stats and Ready go to the control socket.  When
the hub says a worker is gone (`WorkerGone`), its rids' records are dropped and its socket
closed: nothing queues for a process that will never read it.

A TokenOut's log-probabilities go out cut to the tokens the StrOut carries (`output_ids`: a stop
string can end the request mid-batch); its prompt log-probabilities, on the rid's first output,
pass through.

Embeddings have nothing to decode: a `BatchEmbeddingOutput` is passed through to the rids'
workers, stamped (`detok_recv`, `detok_done`), with this hop's spans (`handle_embeddings`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq

from protocol.io_struct import (
    BarrierReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerStats,
    Logprobs,
    Ready,
    StrOut,
    TokenOut,
    WorkerGone,
)
from protocol.reasons import AbortReason, FinishReason
from serving import startup_phases
from serving.args import ServerArgs
from serving.detokenizer.incremental import DecodeState
from serving.ipc import Codec, DropCounter, Endpoints, make_socket
from serving.model_files import load_decoder
from serving.process import enable_stack_dumps, freeze_heap, keep_running, setup_child
from serving.ratelog import RateLimitedLog
from telemetry.clock import now_ns
from telemetry.engine_spans import DetokSpans
from telemetry.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class DetokReq:
    """One rid in the Detokenizer, from its first output to its final one: everything this process keeps of it."""

    worker: int  # the tokenizer worker its outputs go to
    decoder: DecodeState | None  # None once decoding it failed
    ended: str | None = None  # it ended here (a stop string, a decoding failure) while the Scheduler still runs
    # it: its later outputs are discarded quietly until the final one


class DetokenizerManager:
    def __init__(self, tokenizer, tracing: Tracing | None = None) -> None:
        """`tokenizer` decodes every rid's ids; `tracing` records this process's spans (off when None)."""
        self.tokenizer = tokenizer
        self.tracing = tracing or Tracing("detokenizer", enabled=False)
        self.spans = DetokSpans(self.tracing)
        self.reqs: dict[str, DetokReq] = {}
        self.codec = Codec("detokenizer")
        self.drops = DropCounter("detokenizer", on_drop=self.tracing.stale_drop)
        self.errors = RateLimitedLog(log)  # its count is DetokenizerStats.handling_errors
        self.gone: set[int] = set()  # workers that died: their outputs are dropped

    def worker_gone(self, worker: int) -> None:
        self.gone.add(worker)
        for rid in [r for r, req in self.reqs.items() if req.worker == worker]:
            self.forget(rid, AbortReason.WORKER_GONE)
            self.spans.finished(rid, now_ns(), "abort")

    def forget(self, rid: str, reason: str) -> None:
        """The rid ended here (`reason`, what a late output for it is attributed to): its record goes, in this one
        place, whichever way it ended.  Its span ends with its final StrOut (`handle_batch`)."""
        self.reqs.pop(rid, None)
        self.drops.forget(rid, reason)

    def handle_batch(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        recv = now_ns()
        firsts = {o.rid for o in batch.outputs if o.rid not in self.reqs}
        outs = [o for o in (self._guarded(out, recv, batch.sent_at) for out in batch.outputs) if o is not None]
        done = now_ns()
        for o in outs:
            o.meta.stamps.detok_done = done
            self.spans.output(o.rid, o.meta, recv, done, o.rid in firsts)
            if o.finish_reason is not None:
                self.spans.finished(o.rid, done, o.finish_reason)
        return BatchStrOutput(outputs=outs)

    def handle_embeddings(self, batch: BatchEmbeddingOutput) -> dict[int, BatchEmbeddingOutput]:
        """Embeddings have nothing to decode: passed through to their workers, stamped, with this hop's spans."""
        recv = now_ns()
        by_worker: dict[int, list] = {}
        for out in batch.outputs:
            if out.worker in self.gone:
                self.drops.drop("BatchEmbeddingOutput", out.rid, out.meta.trace)
                continue
            st = out.meta.stamps
            st.detok_recv, st.sched_sent, st.detok_done = recv, batch.sent_at, now_ns()
            self.spans.output(out.rid, out.meta, recv, st.detok_done, True)
            self.spans.finished(out.rid, st.detok_done, "stop")
            by_worker.setdefault(out.worker, []).append(out)
        return {w: BatchEmbeddingOutput(outputs=outs) for w, outs in by_worker.items()}

    def _guarded(self, out: TokenOut, recv: int, sent_at: int) -> StrOut | None:
        """`_one`, except that a failure ends this rid alone, with an explicit error."""
        final = out.finish_reason is not None
        if out.worker in self.gone:
            self.drops.drop("BatchTokenIDOutput", out.rid, out.meta.trace)
            return None
        req = self.reqs.get(out.rid)
        if req is not None and req.ended is not None:  # ended here: wait quietly for the engine's final output
            if final:
                self.forget(out.rid, req.ended)
            return None
        try:
            return self._one(out, req, recv, sent_at)
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"could not detokenize the output of request {out.rid[:64]!r}; ending it", exc)
        if final:
            self.forget(out.rid, FinishReason.ERROR)
        else:
            self.reqs[out.rid] = DetokReq(out.worker, None, FinishReason.ERROR)
        return StrOut(
            rid=out.rid,
            text="",
            output_ids=[],
            finish_reason="error",
            abort_in_engine=not final,
            error="the output of this request could not be detokenized",
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            retractions=out.retractions,
            cpu_ns=out.cpu_ns,
            speculative=out.speculative,
            completion_tokens=out.completion_tokens,
            meta=out.meta,
            worker=out.worker,
        )

    def _one(self, out: TokenOut, req: DetokReq | None, recv: int, sent_at: int) -> StrOut | None:
        if req is None:
            if out.detok is None:
                self.drops.drop("BatchTokenIDOutput", out.rid, out.meta.trace)
                return None
            req = self.reqs[out.rid] = DetokReq(out.worker, DecodeState(self.tokenizer, out.detok))
        final = out.finish_reason is not None
        emitted = req.decoder.feed(out.new_token_ids, final)
        out.meta.stamps.detok_recv, out.meta.stamps.sched_sent = recv, sent_at
        res = StrOut(
            rid=out.rid,
            text=emitted.text,
            output_ids=out.new_token_ids[: emitted.consumed],
            finish_reason=out.finish_reason,
            matched_stop=out.matched_stop,
            error=out.error,
            abort_reason=out.abort_reason,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            retractions=out.retractions,
            cpu_ns=out.cpu_ns,
            speculative=out.speculative,
            completion_tokens=req.decoder.consumed,
            logprobs=_sliced(out.logprobs, emitted.consumed, len(out.new_token_ids)),
            prompt_logprobs=out.prompt_logprobs,
            meta=out.meta,
            worker=out.worker,
        )
        if emitted.matched_stop is not None:
            res.finish_reason, res.matched_stop = FinishReason.STOP, emitted.matched_stop
            res.abort_in_engine = not final
            req.ended = FinishReason.STOP
        if final:
            self.forget(out.rid, req.ended or out.finish_reason)
        return res

    def stats(self) -> DetokenizerStats:
        return DetokenizerStats(
            active_rids=len(self.reqs),
            stale_drops=self.drops.snapshot(),
            undecodable=self.codec.undecodable,
            spans=self.tracing.collect_spans(),
            handling_errors=self.errors.count,
        )


def _sliced(lp: Logprobs | None, consumed: int, fed: int) -> Logprobs | None:
    """The log-probabilities of the tokens a StrOut carries: those the decoder consumed (a stop string may end
    the request before the batch's last token), as its `output_ids` are."""
    if lp is None or consumed == fed:
        return lp
    return Logprobs(
        token_logprobs=lp.token_logprobs[:consumed],
        top_ids=lp.top_ids[:consumed],
        top_logprobs=lp.top_logprobs[:consumed],
    )


def _by_worker(outs: list[StrOut]) -> dict[int, list[StrOut]]:
    groups: dict[int, list[StrOut]] = {}
    for o in outs:
        groups.setdefault(o.worker, []).append(o)
    return groups


def run_detokenizer_process(args: ServerArgs, endpoints: Endpoints, instance_id: str = "") -> None:
    """Entry point of the spawned Detokenizer process."""
    parent = setup_child("detokenizer", args)
    clock = startup_phases.start("detokenizer")
    enable_stack_dumps(endpoints.runtime_dir)  # crash dumps: SIGUSR2 writes this process's Python stacks
    ctx = zmq.Context()
    mgr = None
    try:
        control = make_socket(ctx, zmq.PUSH, endpoints.control, do_bind=False)
        codec = Codec("detokenizer")
        startup_phases.report_phases("detokenizer", lambda msg: control.send(codec.encode(msg)))
        clock.begin("tokenizer_load")
        tokenizer = load_decoder(args.model, args.cache_dir_path)
        mgr = DetokenizerManager(tokenizer, Tracing.from_args("detokenizer", args, instance_id))
        recv = make_socket(ctx, zmq.PULL, endpoints.detokenizer_in, do_bind=True)
        to_worker: dict[int, zmq.Socket] = {}

        def send_to(worker: int, msg) -> None:
            sock = to_worker.get(worker)
            if sock is None:
                sock = to_worker[worker] = make_socket(ctx, zmq.PUSH, endpoints.worker_in(worker), do_bind=False)
            if isinstance(msg, (BatchStrOutput, BatchEmbeddingOutput)):
                sent = now_ns()  # as late as the stamp can be: this process stopped before here is its own gap
                for out in msg.outputs:
                    out.meta.stamps.detok_done = sent
            sock.send(mgr.codec.encode(msg))

        freeze_heap()
        phases = clock.finish()
        clock.record_spans(mgr.tracing)
        control.send(mgr.codec.encode(Ready(role="detokenizer", pid=os.getpid(), startup_phases=phases)))
        interval_ms = max(1, int(args.heartbeat_interval * 1000))
        last_stats = 0
        while keep_running(parent):
            if recv.poll(interval_ms):
                data = recv.recv()
                try:
                    msg = mgr.codec.decode(data)
                    if isinstance(msg, (BatchTokenIDOutput, BatchEmbeddingOutput)):
                        if isinstance(msg, BatchTokenIDOutput):
                            batches = {
                                w: BatchStrOutput(outputs=outs)
                                for w, outs in _by_worker(mgr.handle_batch(msg).outputs).items()
                            }
                        else:
                            batches = mgr.handle_embeddings(msg)
                        for worker, batch in batches.items():
                            send_to(worker, batch)
                        mgr.spans.producers.sent()
                    elif isinstance(msg, BarrierReq):  # behind every output so far, on each path (see BarrierReq)
                        control.send(mgr.codec.encode(mgr.stats()))
                        msg.path = "detokenizer"
                        control.send(mgr.codec.encode(msg))
                        msg.path = "output"
                        send_to(msg.worker, msg)
                    elif isinstance(msg, WorkerGone):
                        mgr.worker_gone(msg.worker)
                        if msg.worker in to_worker:
                            to_worker.pop(msg.worker).close(linger=0)
                    elif msg is not None:
                        mgr.codec.undecodable += 1
                        log.warning("unexpected %s on the detokenizer socket", type(msg).__name__)
                except Exception as exc:  # noqa: BLE001 - one bad message must not stop the process
                    mgr.errors.report(f"dropped a message of {len(data)} bytes whose handling failed", exc)
            if now_ns() - last_stats >= args.heartbeat_interval * 1e9:
                last_stats = now_ns()
                control.send(mgr.codec.encode(mgr.stats()))
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)
        if mgr is not None:
            mgr.tracing.shutdown()
