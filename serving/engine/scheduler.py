"""The Scheduler process: a blocking loop around the engine (`SchedulerCore`).

    recv (non-blocking while busy, blocking up to a heartbeat when idle)
      → add / abort requests → one engine step → BatchTokenIDOutput to the Detokenizer
      → SchedulerStats to the TokenizerManager (after every step; a heartbeat when idle)

An embeddings request (`TokenizedEmbeddingReqInput`) is one prefill-only engine request per
input, answered once with a `BatchEmbeddingOutput` (`serving.engine.embed_groups`).

Each step reads schedule → run → emit: the engine schedules and runs one batch
(`SchedulerCore.step`), its events become outputs (`serving.engine.outputs`: one `Envelope`
per rid, one `forget` for every ending) and its plain record (`StepStats`) goes to the
observers (`serving.engine.step_observers`: counters, spans, gaps, phases, the timeline).

It never awaits: the forward pass owns the CPU.  Per-rid `ReqMeta` (trace carrier and
timestamps) arrives with the request and leaves, updated, with every output.

Paused (`PauseReq`, POST /pause_generation mode in_place) it runs no step: its requests
keep their place and their KV, while it still receives messages (aborts free KV as
usual), expires the queue and heartbeats every --heartbeat-interval; `ContinueReq` steps
again from exactly where it stopped.

Nothing one message carries may stop the loop: a request the engine cannot take or
serve ends alone with an explicit error; a message whose handling raises is dropped,
counted (`SchedulerStats.handling_errors`) and logged at most once a second.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import zmq

from protocol.io_struct import (
    AbortReq,
    BarrierReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    ContinueReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    Message,
    PauseReq,
    Ready,
    ReleaseHeldReq,
    SchedulerStats,
    SetLogLevelReq,
    StepTimelineOutput,
    StepTimelineReq,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    WorkerGone,
)
from protocol.reasons import ENGINE_ERROR, AbortReason, FinishReason
from serving import startup_phases
from serving.args import ServerArgs
from serving.engine import peak_probe
from serving.engine.cpu_share import CpuLedger
from serving.engine.embed_groups import EmbedGroups
from serving.engine.embedding import pooling_config
from serving.engine.kv_event_publisher import KVEvents, KVEventsError
from serving.engine.loader import load_model
from serving.engine.outputs import Outputs
from serving.engine.queue_head import queue_head
from serving.engine.scheduler_core import SchedulerCore
from serving.engine.step_observers import StepObservers
from serving.engine.utilisation import ModelShape
from serving.engine.wait_reasons import PAUSED, assign
from serving.ipc import Codec, DropCounter, Endpoints, make_socket, scheduler_role
from serving.model_errors import EXIT_KV_EVENTS
from serving.model_files import EXIT_MODEL_LOAD, ModelLoadError
from serving.process import enable_stack_dumps, freeze_heap, keep_running, setup_child
from serving.ratelog import RateLimitedLog
from serving.startup_phases import report_phases
from telemetry.clock import now_ns
from telemetry.engine_spans import SchedulerSpans
from telemetry.tracing import Tracing

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, instance_id: str = "", dp_rank: int = 0) -> None:
        self.args = args
        self.dp_rank = dp_rank
        self.tracing = Tracing.from_args(
            "scheduler", args, instance_id, where={"sightline.dp_rank": dp_rank} if args.dp_size > 1 else None
        )
        self.spans = SchedulerSpans(self.tracing)
        self.kv_events = KVEvents.open(args, dp_rank)  # before the model: a taken endpoint fails the start at once
        self.ctx = zmq.Context()
        self.to_tm = make_socket(self.ctx, zmq.PUSH, endpoints.control, do_bind=False)
        self.codec = Codec("scheduler")
        self.startup = report_phases(
            scheduler_role(dp_rank, args.dp_size), lambda msg: self.to_tm.send(self.codec.encode(msg))
        )
        startup_phases.begin("model_resolve")
        loaded = load_model(args.model, cache_dir=args.cache_dir_path, served_name=args.served_model_name)
        self.model_name = loaded.name
        self.architecture = loaded.architecture
        self.pooling = pooling_config(loaded.path, args.pooling, loaded.encoder)  # None: generation only
        self.core = SchedulerCore(loaded, args)
        if self.kv_events is not None:
            self.kv_events.watch(self.core.tree)
        self.recv_sock = make_socket(self.ctx, zmq.PULL, endpoints.scheduler_in(dp_rank), do_bind=True)
        self.to_detok = make_socket(self.ctx, zmq.PUSH, endpoints.detokenizer_in, do_bind=False)
        self.drops = DropCounter("scheduler", on_drop=self.tracing.stale_drop)
        self._last_stats = 0
        self.pause_epoch = 0  # the epoch of the PauseReq in effect: no step runs while it is set
        self._paused_at = 0
        runner = self.core.runner
        shape = (
            None
            if runner.encoder
            else ModelShape.served(loaded.hf_model.config, runner.precision.dtype, runner.precision.quantization)
        )
        peak = None
        if args.peak_probe:
            startup_phases.begin("peak_probe")
            peak = peak_probe.measure()
        self.observers = StepObservers(args, self.spans, shape, peak)
        self.errors = RateLimitedLog(log)  # its count is SchedulerStats.handling_errors
        self.cpu = CpuLedger()  # each rid's share of the steps' CPU time (per-tenant usage)
        self.embeds = EmbedGroups(self.core, self.spans, self.cpu, self.errors)
        self.outputs = Outputs(
            self.core,
            self.spans,
            self.cpu,
            self.drops,
            self.embeds,
            self.errors,
            timeline=self.observers.ring is not None,
        )

    # -- intake -------------------------------------------------------------------
    def recv_requests(self, timeout_ms: int) -> None:
        """Handle every queued message; wait up to `timeout_ms` for the first one."""
        if timeout_ms and not self.recv_sock.poll(timeout_ms):
            return
        while True:
            try:
                data = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.codec.decode(data)
            try:
                self.on_message(msg)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the engine
                self.errors.report(f"dropped a {type(msg).__name__} whose handling failed", exc)

    def on_message(self, msg: Message | None) -> None:
        """One decoded message from a TokenizerManager (None: it could not be decoded, already counted)."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self._add(msg)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self._add_embedding(msg)
        elif isinstance(msg, AbortReq):
            self._abort(msg)
        elif isinstance(msg, FlushCacheReq):
            self._flush_cache(msg)
        elif isinstance(msg, StepTimelineReq):
            ring = self.observers.ring
            self.to_tm.send(
                self.codec.encode(
                    StepTimelineOutput(
                        id=msg.id,
                        worker=msg.worker,
                        dp_rank=self.dp_rank,
                        steps=ring.since(msg.seconds) if ring is not None else [],
                    )
                )
            )
        elif isinstance(msg, WorkerGone):
            self._worker_gone(msg.worker)
        elif isinstance(msg, BarrierReq):
            self._barrier(msg)
        elif isinstance(msg, ReleaseHeldReq):
            log.info("released %d held requests", self.core.release(msg.rids))
        elif isinstance(msg, (PauseReq, ContinueReq, SetLogLevelReq)):
            self._control(msg)
        elif msg is not None:
            self.codec.undecodable += 1
            log.warning("unexpected %s on the scheduler socket", type(msg).__name__)

    def _add(self, msg: TokenizedGenerateReqInput) -> None:
        msg.meta.stamps.sched_recv = now_ns()
        try:
            req = self.core.add_request(msg.rid, msg.input_ids, msg.sampling, msg.priority, msg.cache_namespace)
        except Exception as exc:  # noqa: BLE001 - the TM validates first; this is the last line of defence
            if not isinstance(exc, ValueError):  # ValueError: a client error, said to the client
                self.errors.report(f"could not queue request {msg.rid[:64]!r}", exc)
            self.outputs.refused(
                msg, str(exc) if isinstance(exc, ValueError) else "the engine could not queue this request"
            )
            return
        self.outputs.opened(msg)
        req.times.queued = req.times.waiting_since = msg.meta.stamps.sched_recv
        if self.pause_epoch:
            assign([req], PAUSED, req.times.queued)
        self.observers.prompt_tokens_total += req.prompt_len
        self.spans.received(msg.rid, msg.meta, req.times.queued, now_ns())

    def _add_embedding(self, msg: TokenizedEmbeddingReqInput) -> None:
        refused = self.embeds.add(msg, now_ns())
        if refused is not None:
            self.outputs.outbox.append(refused)
        else:
            self.observers.prompt_tokens_total += sum(map(len, msg.inputs))

    def _abort(self, msg: AbortReq) -> None:
        if msg.rid in self.embeds.groups:
            self.outputs.embedding_ended(self.embeds.abort(msg.rid, msg.reason))
            return
        event = self.core.abort(msg.rid)
        if event is None:
            self.drops.drop("AbortReq", msg.rid, msg.meta.trace)
            return
        log.debug("aborted %s (%s)", msg.rid, msg.reason)
        # a stop string ended it in the Detokenizer: a normal finish, not a failure
        self.outputs.emit(event, None if msg.reason == AbortReason.STOP_STRING else msg.reason)

    def _worker_gone(self, worker: int) -> None:
        """Its client connections died with it: free its requests without a word (no one to hear it)."""
        self.embeds.worker_gone(worker)
        rids = self.outputs.rids_of(worker)
        for rid in rids:
            ev = self.core.abort(rid)
            self.outputs.forget(
                rid,
                AbortReason.WORKER_GONE,
                ev.req if ev is not None else None,
                FinishReason.ABORT,
                AbortReason.WORKER_GONE,
            )
        log.warning("tokenizer worker %d is gone: aborted its %d requests", worker, len(rids))

    def _barrier(self, msg: BarrierReq) -> None:
        """Answer on both paths, behind everything this rank has to send so far (see `BarrierReq`)."""
        self.send_outputs()
        self.send_stats(force=True)
        self.to_tm.send(
            self.codec.encode(BarrierReq(id=msg.id, worker=msg.worker, dp_rank=self.dp_rank, path="control"))
        )
        self.to_detok.send(
            self.codec.encode(BarrierReq(id=msg.id, worker=msg.worker, dp_rank=self.dp_rank, path="output"))
        )

    def _control(self, msg: PauseReq | ContinueReq | SetLogLevelReq) -> None:
        if isinstance(msg, SetLogLevelReq):
            logging.getLogger().setLevel(msg.level.upper())
            log.info("log level set to %s", msg.level)
            return
        was, self.pause_epoch = self.pause_epoch, msg.epoch if isinstance(msg, PauseReq) else 0
        if self.pause_epoch and not was:  # the queue waits for the pause now; the next step says why it waits after
            self._paused_at = now_ns()
            assign(self.core.waiting, PAUSED, self._paused_at)
        elif was and not self.pause_epoch:
            self.observers.resumed(self._paused_at)
        if bool(was) != bool(self.pause_epoch):
            log.info(
                "%s with %d running and %d waiting requests",
                "paused" if self.pause_epoch else "resumed",
                self.core.num_running,
                self.core.num_waiting,
            )
        self.send_stats(force=True)  # the front end waits for this to say the pause is in effect

    def _flush_cache(self, msg: FlushCacheReq) -> None:
        before = self.core.prefix_cached_tokens
        to = {"id": msg.id, "worker": msg.worker, "dp_rank": self.dp_rank}
        if self.core.tree is None:
            reply = FlushCacheReqOutput(**to, success=False, message="the prefix cache is disabled")
        elif self.core.flush_cache(msg.force):
            reply = FlushCacheReqOutput(**to, success=True, flushed_tokens=before - self.core.prefix_cached_tokens)
        else:
            reply = FlushCacheReqOutput(
                **to,
                success=False,
                message=(
                    f"{self.core.num_running} requests are running; flush when idle, or force it (only the prefixes "
                    "nothing uses are dropped)"
                ),
            )
        log.info("flush_cache (force=%s): %s", msg.force, reply.message or f"freed {reply.flushed_tokens} KV slots")
        self.to_tm.send(self.codec.encode(reply))
        self.send_stats(force=True)  # the KV gauges show the flush at once

    # -- outputs --------------------------------------------------------------------
    def send_outputs(self) -> None:
        """The KV events of the step, then the outbox as one batch to the Detokenizer (and the embeddings
        answered, as another)."""
        if self.kv_events is not None:
            self.kv_events.send()
        if self.outputs.outbox:
            outputs, self.outputs.outbox = self.outputs.outbox, []
            self.to_detok.send(self.codec.encode(BatchTokenIDOutput(outputs=outputs)))
            self.spans.producers.sent()
        if self.embeds.outbox:
            embedded, self.embeds.outbox = self.embeds.outbox, []
            self.to_detok.send(self.codec.encode(BatchEmbeddingOutput(outputs=embedded)))
            self.spans.producers.sent()

    def send_stats(self, force: bool = False) -> None:
        now = now_ns()
        if not force and now - self._last_stats < self.args.heartbeat_interval * 1e9:
            return
        self._last_stats = now
        self.to_tm.send(self.codec.encode(self.make_stats()))

    def make_stats(self) -> SchedulerStats:
        """The stats message: the engine's fields (`SchedulerCore.stats`) and this process's (`stats`)."""
        return SchedulerStats(**self.core.stats(), **self.stats())

    def stats(self) -> dict[str, object]:
        """This process's part of `SchedulerStats`, by field name: its observers', drops, spans and pause."""
        return {
            "dp_rank": self.dp_rank,
            **self.observers.stats(),
            "stale_drops": self.drops.snapshot(),
            "undecodable": self.codec.undecodable,
            "spans": self.tracing.collect_spans(),
            "handling_errors": self.errors.count,
            "paused": self.pause_epoch,
            **queue_head(self.core, now_ns(), bool(self.pause_epoch)),
            **KVEvents.stats_of(self.kv_events),
            **({"prefix_misses": self.core.cache.misses.snapshot()} if self.core.cache.misses is not None else {}),
        }

    # -- the loop ---------------------------------------------------------------------
    def step(self) -> None:
        """Schedule and run one batch (`SchedulerCore.step`), then emit: its outputs built and sent, its record
        (`StepStats`) and events given to the observers."""
        cpu0, t0 = time.process_time_ns(), time.monotonic()
        try:
            events = self.core.step()
        except Exception as exc:  # noqa: BLE001 - a bug outside any one request: fail the batch, not hang it
            self.errors.report("engine step failed; failing the running batch", exc)
            for req in list(self.core.running):
                self.outputs.emit(self.core.abort(req.rid), ENGINE_ERROR, "internal engine error")
            return
        st = self.core.last_step
        floor = self.core.seams.step_floor_s  # test seam: a step lasts at least this long
        if floor and st.batch_size and time.monotonic() - t0 < floor:
            time.sleep(floor - (time.monotonic() - t0))
        self.cpu.charge(st.rids, st.tokens, time.process_time_ns() - cpu0)
        t_out = now_ns()
        traces = self.outputs.trace_ids(st.rids) if self.observers.ring is not None else ()  # before finishes
        self.observers.ran(st, events)
        for ev in events:  # an event with an error: the engine failed that request alone
            self.outputs.emit(ev, ENGINE_ERROR if ev.error is not None else None, ev.error)
        self.send_outputs()
        self.observers.sent(st, traces, now_ns() - t_out)

    def expire_queue(self) -> None:
        """Abort requests that waited in the queue longer than --max-queue-time before they first ran (a
        retracted request, back in the queue, has started answering: it is not expired)."""
        limit = self.args.max_queue_time
        if not limit or not self.core.waiting:
            return
        now = now_ns()
        for req in [r for r in self.core.waiting if r.times.scheduled is None and now - r.times.queued > limit * 1e9]:
            ev = self.core.abort(req.rid)
            self.outputs.emit(ev, AbortReason.TIMEOUT, f"the request waited more than {limit:g} s in the queue")

    def event_loop(self, parent: int) -> None:
        freeze_heap()
        phases = self.startup.finish()
        self.startup.record_spans(self.tracing)
        self.to_tm.send(
            self.codec.encode(
                Ready(
                    startup_phases=phases,
                    role=scheduler_role(self.dp_rank, self.args.dp_size),
                    pid=os.getpid(),
                    dp_rank=self.dp_rank,
                    model_name=self.model_name,
                    architecture=self.architecture,
                    sliding_window=self.core.runner.window or 0,
                    context_len=self.core.context_len,
                    vocab_size=self.core.vocab_size,
                    kv_total=self.core.pool.capacity,
                    dtype=self.core.runner.precision.dtype,
                    quantization=self.core.runner.precision.quantization,
                    pooling=self.pooling.mode if self.pooling else "",
                    hidden_size=self.core.runner.model.dims.hidden,
                    embedding_only=bool(self.pooling and self.pooling.embedding_only),
                    normalize=self.pooling.normalize if self.pooling else True,
                    encoder=self.core.encoder,
                )
            )
        )
        idle_ms = max(1, int(self.args.heartbeat_interval * 1000))
        while keep_running(parent):
            busy = self.core.has_work and not self.pause_epoch  # paused: wait for messages as when idle
            # a step that ran nothing (the queue's head blocked by held requests) waits a little for a message
            blocked = busy and self.observers.steps and not self.core.last_step.batch_size and self.core.num_held
            try:
                self.recv_requests(0 if busy and not blocked else (5 if busy else idle_ms))
                self.expire_queue()
                if self.core.has_work and not self.pause_epoch:
                    self.step()
                self.send_outputs()
                self.send_stats(force=busy)
            except Exception as exc:  # noqa: BLE001 - never fatal; the watchdog sees a loop that stops stepping
                self.errors.report("scheduler loop iteration failed", exc)

    def close(self) -> None:
        self.startup.finish()  # a Scheduler closed before its Ready: nothing more goes to its closed socket
        if self.kv_events is not None:
            self.kv_events.close()
        self.core.grammar.close()
        self.ctx.destroy(linger=0)
        self.tracing.shutdown()


def run_scheduler_process(args: ServerArgs, endpoints: Endpoints, instance_id: str = "", dp_rank: int = 0) -> None:
    """Entry point of the spawned Scheduler process (rank `dp_rank` of `--dp-size`)."""
    parent = setup_child(scheduler_role(dp_rank, args.dp_size), args)
    startup_phases.start(scheduler_role(dp_rank, args.dp_size))
    enable_stack_dumps(endpoints.runtime_dir)  # crash dumps: SIGUSR2 writes this process's Python stacks
    sched = None
    try:
        sched = Scheduler(args, endpoints, instance_id, dp_rank)
        sched.event_loop(parent)
    except ModelLoadError as exc:  # one line for the operator, not a traceback; the supervisor reports the exit
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_MODEL_LOAD) from None
    except KVEventsError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_KV_EVENTS) from None
    except KeyboardInterrupt:
        pass
    finally:
        if sched is not None:
            sched.close()
