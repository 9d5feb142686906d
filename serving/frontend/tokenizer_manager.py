"""The TokenizerManager: asyncio, in the main process, between HTTP and the engine.

As in the seed: `submit` tokenizes and validates a request, creates its `ReqState`
in `rid_to_state` and pushes it to the Scheduler; `handle_loop` receives Detokenizer
and Scheduler messages and dispatches them by type; the HTTP handler reads a state's
outputs with `stream` (or `collect`).  A rid leaves `rid_to_state` when it finishes or
when its client goes away (`abort`, which also reaches the Scheduler to free its KV).
Outputs arriving for a rid no longer there are dropped and counted by reason.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from serving.args import ServerArgs
from protocol.sampling_params import SamplingParams
from serving.frontend.errors import APIError, bad_request
from protocol.io_struct import (
    AbortReq, BatchStrOutput, DetokenizerStats, DetokParams, Ready, ReqMeta, SchedulerStats, Stamps, StrOut,
    TokenizedGenerateReqInput,
)
from serving.ipc import Codec, DropCounter, Endpoints, make_socket
from serving.ratelog import RateLimitedLog
from serving.frontend.tokenization import InputLimits, PromptTokenizer, check_size, prompt_too_long
from telemetry.clock import now_ns
from telemetry.request_telemetry import RequestTelemetry, RequestTrace

log = logging.getLogger(__name__)
_RID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
PROMPT_TAIL = 5  # prompt tokens the Detokenizer decodes the first output token against


@dataclass
class GenerateReqInput:
    """One request as the HTTP layer hands it over (prompt, messages or token ids)."""

    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_new_tokens: int | None = None  # None: up to the context window
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    stream: bool = False
    rid: str | None = None
    param_names: dict[str, str] = field(default_factory=dict)  # engine field → API field, for errors
    timeout: float | None = None  # seconds until the request is aborted with a timeout error


@dataclass
class ReqState:
    """What the TM knows about one in-flight rid (SGLang's ReqState)."""

    rid: str
    prompt_tokens: int
    meta: ReqMeta
    trace: RequestTrace
    out_list: list[StrOut] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finish_reason: str | None = None
    completion_tokens: int = 0
    breakdown: dict | None = None  # the latency breakdown, once finished
    started: bool = False  # the engine produced its first output (it no longer counts as queued)
    budget_tokens: int = 0  # prompt + max_new_tokens, counted against --max-inflight-tokens
    timer: asyncio.TimerHandle | None = None
    client_rid: str = ""  # what the client calls it (its `rid`, else ours): echoed, never used to route


@dataclass
class Collected:
    """A finished request, for non-streaming responses."""

    rid: str  # as the client knows it (ReqState.client_rid)
    text: str
    output_ids: list[int]
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None


class RateWindow:
    """Rate of a cumulative counter over the last few seconds (tokens/s from stats)."""

    def __init__(self, seconds: float) -> None:
        self.window_ns = int(seconds * 1e9)
        self.points: deque[tuple[int, int]] = deque()

    def add(self, t: int, total: int) -> None:
        if self.points and total < self.points[-1][1]:
            self.points.clear()  # the counter restarted (a new Scheduler)
        self.points.append((t, total))
        while len(self.points) > 2 and self.points[1][0] < t - self.window_ns:
            self.points.popleft()

    def rate(self, now: int) -> float:
        if len(self.points) < 2 or now - self.points[-1][0] > self.window_ns:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / ((t1 - t0) / 1e9) if t1 > t0 else 0.0


class TokenizerManager:
    def __init__(self, args: ServerArgs, endpoints: Endpoints, tokenizer: Any, model_name: str,
                 telemetry: RequestTelemetry) -> None:
        self.args = args
        self.tel = telemetry
        self.tokenizer = tokenizer
        self.prompts = PromptTokenizer(tokenizer)
        self.model_name = model_name
        self.ctx = zmq.asyncio.Context()
        self.endpoints = endpoints
        self.to_scheduler = make_socket(self.ctx, zmq.PUSH, endpoints.scheduler_in, do_bind=False)
        self.from_detok = make_socket(self.ctx, zmq.PULL, endpoints.tm_from_detokenizer, do_bind=True)
        self.from_sched = make_socket(self.ctx, zmq.PULL, endpoints.tm_from_scheduler, do_bind=True)
        self.codec = Codec("tokenizer_manager")
        self.drops = DropCounter("tokenizer_manager", on_drop=telemetry.tracing.stale_drop)
        self.handling_errors = RateLimitedLog(log)
        self.rid_to_state: dict[str, ReqState] = {}
        self.ready: dict[str, Ready] = {}
        self.all_ready = asyncio.Event()
        # role -> pid of the child the supervisor just spawned and awaits the Ready of (set by it, once per start)
        self.awaiting_ready: dict[str, int] = {}
        self.ready_rejected: dict[str, int] = {}  # Ready messages refused, by reason
        self.ready_log = RateLimitedLog(log, interval=10.0, level=logging.WARNING)
        self.scheduler_stats: SchedulerStats | None = None
        self.detok_stats: DetokenizerStats | None = None
        self.last_heartbeat: dict[str, int] = {}
        self._dispatch: dict[type, Callable[[Any], None]] = {
            BatchStrOutput: self._handle_str_output,
            SchedulerStats: self._handle_scheduler_stats,
            DetokenizerStats: self._handle_detok_stats,
            Ready: self._handle_ready,
        }
        self._tasks: list[asyncio.Task] = []
        self.throughput = RateWindow(seconds=5.0)
        self.num_queued = 0  # in flight, no output yet
        self.inflight_tokens = 0

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.handle_loop(s)) for s in (self.from_detok, self.from_sched)]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.prompts.close()
        self.ctx.destroy(linger=0)

    @property
    def context_len(self) -> int:
        return self.ready["scheduler"].context_len

    @property
    def vocab_size(self) -> int:
        return self.ready["scheduler"].vocab_size

    def reset_engine(self) -> None:
        """The children are being replaced: forget what they said; drop messages queued for the dead one."""
        self.ready.clear()
        self.all_ready.clear()
        self.awaiting_ready.clear()
        self.scheduler_stats = self.detok_stats = None
        self.last_heartbeat.clear()
        self.to_scheduler.close(linger=0)
        self.to_scheduler = make_socket(self.ctx, zmq.PUSH, self.endpoints.scheduler_in, do_bind=False)

    def oldest_arrival(self) -> int | None:
        return min((s.trace.arrival for s in self.rid_to_state.values()), default=None)

    # -- receiving ------------------------------------------------------------------
    async def handle_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            data = await sock.recv()
            msg = self.codec.decode(data)
            handler = self._dispatch.get(type(msg)) if msg is not None else None
            if handler is None:
                if msg is not None:
                    self.codec.undecodable += 1
                    log.warning("unexpected %s on a TokenizerManager socket", type(msg).__name__)
                continue
            try:
                handler(msg)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the loop
                self.handling_errors.report(f"failed to handle {type(msg).__name__}", exc)

    def _handle_str_output(self, batch: BatchStrOutput) -> None:
        recv = now_ns()
        self.tel.on_batch(batch, recv)
        for out in batch.outputs:
            state = self.rid_to_state.get(out.rid)
            if state is None:
                self.drops.drop("BatchStrOutput", out.rid, out.meta.trace)
                continue
            try:
                self._apply_output(state, out, recv)
            except Exception as exc:  # noqa: BLE001 - one rid's bad output ends that rid alone
                self.handling_errors.report(f"failed to handle an output of {out.rid}; ending it with an error", exc)
                self.abort(out.rid, "internal_error", "internal error while handling this request's output")
            state.event.set()

    def _apply_output(self, state: ReqState, out: StrOut, recv: int) -> None:
        state.out_list.append(out)
        state.meta = out.meta
        state.completion_tokens = out.completion_tokens
        if not state.started:
            state.started = True
            self.num_queued -= 1
        self.tel.on_output(state.trace, out, recv)
        if out.finish_reason is not None:
            self._finish(state, out.finish_reason, out.abort_reason, out.error)
            if out.engine_running:  # the Detokenizer ended it (a stop string, or it failed there)
                self._send_abort(out.rid, "stop_string" if out.finish_reason == "stop" else "detokenizer_error",
                                 state.meta)

    def _finish(self, state: ReqState, reason: str, abort_reason: str | None, error: str | None) -> None:
        """The rid leaves rid_to_state: mark it, count it, observe it (exactly once)."""
        state.finished, state.finish_reason = True, reason
        self.rid_to_state.pop(state.rid, None)
        if not state.started:
            self.num_queued -= 1
        self.inflight_tokens -= state.budget_tokens
        if state.timer is not None:
            state.timer.cancel()
        self.drops.forget(state.rid, abort_reason or reason)
        state.breakdown = self.tel.finish(state.trace, reason, state.completion_tokens, abort_reason, error)

    def _handle_scheduler_stats(self, msg: SchedulerStats) -> None:
        now = now_ns()
        self.scheduler_stats = msg
        self.last_heartbeat["scheduler"] = now
        self.throughput.add(now, msg.generation_tokens_total)
        self.tel.on_stats(msg, now)

    def _handle_detok_stats(self, msg: DetokenizerStats) -> None:
        self.detok_stats = msg
        self.last_heartbeat["detokenizer"] = now_ns()
        self.tel.on_stats(msg, None)

    def _handle_ready(self, msg: Ready) -> None:
        """Apply a Ready only from the child just spawned for its role, once; count and drop any other.

        A Ready sets the context length and vocabulary every request is validated against:
        one from anyone else (a stale child, a stray writer on the socket) must never apply.
        """
        expected = self.awaiting_ready.get(msg.role)
        if expected is None or msg.pid != expected:
            reason = "not_starting" if expected is None else "wrong_pid"
            self.ready_rejected[reason] = self.ready_rejected.get(reason, 0) + 1
            self.codec.undecodable += 1  # an unexpected message: reported with the undecodable ones
            why = "no start of that role is awaiting one" if expected is None \
                else f"the {msg.role} just spawned has pid {expected}"
            self.ready_log.report(f"ignored a Ready(role={msg.role[:32]!r}, pid={msg.pid}): {why}")
            return
        del self.awaiting_ready[msg.role]  # once per start
        log.info("%s ready (pid %d)", msg.role, msg.pid)
        self.ready[msg.role] = msg
        self.last_heartbeat[msg.role] = now_ns()
        if {"scheduler", "detokenizer"} <= self.ready.keys():
            self.all_ready.set()

    # -- submitting -------------------------------------------------------------------
    def _validate(self, obj: GenerateReqInput, ids: list[int]) -> None:
        names = obj.param_names
        if not ids:
            raise bad_request("prompt is empty", param="messages" if obj.messages is not None else "prompt",
                              code="empty_prompt")
        ctx = self.context_len
        if len(ids) >= ctx:
            raise prompt_too_long(ctx, len(ids), "messages" if obj.messages is not None else "prompt")
        want = obj.max_new_tokens
        obj.sampling.max_new_tokens = ctx - len(ids) if want is None else want
        if want is not None and len(ids) + want > ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, you requested "
                              f"{len(ids) + want} tokens ({len(ids)} in the prompt, {want} for the completion).",
                              param=names.get("max_new_tokens", "max_new_tokens"), code="context_length_exceeded")
        try:
            obj.sampling.validate(self.vocab_size)
        except ValueError as exc:
            field_name = str(exc).split(" ", 1)[0]
            param = names.get(field_name, field_name)
            raise bad_request(str(exc).replace(field_name, param, 1), param=param) from None

    async def submit(self, obj: GenerateReqInput, rt: RequestTrace) -> ReqState:
        """Tokenize, validate and send; raises APIError (4xx/503) before anything is sent.

        The internal rid is always fresh (a client's `rid` is only echoed back): a client
        reusing its rid right after a disconnect must never receive the old request's
        late outputs or abort.
        """
        self._check_ready()
        if obj.rid is not None and not _RID.match(obj.rid):
            raise bad_request("rid must be 1-128 characters [A-Za-z0-9._:-]", param="rid")
        rid = uuid.uuid4().hex
        self._check_queue()
        check_size(obj, self.context_len, self.input_limits())
        t0 = now_ns()
        ids = await self.prompts.encode(obj, self.vocab_size)
        t1 = now_ns()
        self._check_ready()  # the engine may have been replaced while this request was tokenized
        self._validate(obj, ids)
        self._check_queue()  # others may have been admitted meanwhile
        budget = len(ids) + obj.sampling.max_new_tokens
        if self.inflight_tokens + budget > self.args.inflight_token_limit and self.rid_to_state:
            raise self._overloaded("tokens_full", f"{self.inflight_tokens} prompt+output tokens are in flight")
        self.tel.tokenized(rt, rid, t0, t1, len(ids))
        carrier, producer = self.tel.producer(rt)
        meta = ReqMeta(trace=carrier, stamps=Stamps(arrival=rt.arrival, tokenized=now_ns()))
        state = ReqState(rid=rid, prompt_tokens=len(ids), meta=meta, trace=rt, budget_tokens=budget,
                         client_rid=obj.rid or rid)
        self.rid_to_state[rid] = state
        self.num_queued += 1
        self.inflight_tokens += budget
        if obj.timeout:
            state.timer = asyncio.get_running_loop().call_later(
                obj.timeout, self.abort, rid, "timeout", f"the request timed out after {obj.timeout:g} s")
        detok = DetokParams(stop=obj.stop, skip_special_tokens=obj.skip_special_tokens, prompt_tail=ids[-PROMPT_TAIL:])
        self.to_scheduler.send(self.codec.encode(TokenizedGenerateReqInput(
            rid=rid, input_ids=ids, sampling=obj.sampling, detok=detok, meta=meta)))
        if producer is not None:
            producer.end()
        return state

    def _check_ready(self) -> None:
        if not self.all_ready.is_set():
            raise APIError(503, "the server is starting; retry shortly", type="server_unavailable")

    def _check_queue(self) -> None:
        if self.num_queued >= self.args.max_queued_requests:
            raise self._overloaded("queue_full", f"{self.num_queued} requests are already waiting")

    def input_limits(self) -> InputLimits:
        return InputLimits.for_context(self.context_len, self.args.max_prompt_chars, self.args.max_messages)

    def _overloaded(self, reason: str, detail: str) -> APIError:
        """429 with a Retry-After estimated from the recent token rate."""
        rate = self.throughput.rate(now_ns())
        wait = self.inflight_tokens / rate if rate > 0 else 1.0
        retry_after = str(max(1, min(60, int(wait) + 1)))
        self.tel.shed(reason)
        return APIError(429, f"server overloaded: {detail}; retry after {retry_after} s", type="overloaded_error",
                        code=reason, headers={"retry-after": retry_after})

    # -- reading outputs ----------------------------------------------------------------
    async def stream(self, state: ReqState) -> AsyncIterator[StrOut]:
        """Yield the rid's outputs as they arrive; aborts it if the reader goes away first."""
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                outs, state.out_list = state.out_list, []
                for out in outs:
                    yield out
                if state.finished and not state.out_list:
                    return
        finally:
            if not state.finished:
                self.abort(state.rid, "client_disconnect")

    async def collect(self, state: ReqState) -> Collected:
        text: list[str] = []
        ids: list[int] = []
        last: StrOut | None = None
        async for out in self.stream(state):
            text.append(out.text)
            ids.extend(out.output_ids)
            last = out
        if last is None:  # aborted before any output (shutdown, engine failure)
            return Collected(state.client_rid, "", [], "error", None, state.prompt_tokens, 0, "the request was aborted")
        return Collected(state.client_rid, "".join(text), ids, last.finish_reason, last.matched_stop,
                         state.prompt_tokens, last.completion_tokens, last.error)

    def abort(self, rid: str, reason: str, error: str | None = None) -> None:
        """Forget the rid here and tell the Scheduler to free it; the reader gets `error` if given."""
        state = self.rid_to_state.get(rid)
        if state is None:
            return
        if error is not None:
            state.out_list.append(StrOut(rid=rid, text="", output_ids=[], finish_reason="abort", error=error,
                                         abort_reason=reason, prompt_tokens=state.prompt_tokens,
                                         completion_tokens=state.completion_tokens, meta=state.meta))
        self._finish(state, "abort", reason, error)
        state.event.set()
        self._send_abort(rid, reason, state.meta)

    def abort_all(self, reason: str, message: str) -> None:
        """End every in-flight request with an explicit error (shutdown, engine failure)."""
        for rid in list(self.rid_to_state):
            self.abort(rid, reason, error=message)

    def _send_abort(self, rid: str, reason: str, meta: ReqMeta) -> None:
        self.to_scheduler.send(self.codec.encode(AbortReq(rid=rid, reason=reason, meta=meta)))

    # -- introspection ------------------------------------------------------------------
    def stale_drops(self) -> list:
        """Stale-drop counters of all three processes (the children's from their latest stats)."""
        drops = self.drops.snapshot()
        for st in (self.scheduler_stats, self.detok_stats):
            if st is not None:
                drops += st.stale_drops
        return drops

    def debug_state(self) -> dict:
        drops = self.stale_drops()
        return {
            "in_flight": len(self.rid_to_state),
            "ready": sorted(self.ready),
            "scheduler": msgspec.to_builtins(self.scheduler_stats) if self.scheduler_stats else None,
            "detokenizer": msgspec.to_builtins(self.detok_stats) if self.detok_stats else None,
            "stale_drops": [msgspec.to_builtins(d) for d in drops],
            "undecodable": {"tokenizer_manager": self.codec.undecodable,
                            "scheduler": self.scheduler_stats.undecodable if self.scheduler_stats else 0,
                            "detokenizer": self.detok_stats.undecodable if self.detok_stats else 0},
        }
