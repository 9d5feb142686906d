"""The TokenizerManager: asyncio, in the main process, between HTTP and the engine.

As in SGLang's TokenizerManager: `submit` tokenizes and validates a request, puts its
`ReqState` in `rid_to_state` and sends it to the Scheduler; every message from the
children arrives in `on_message` (outputs here, everything else to its `EngineState`: the
`EngineMonitor`, or a tokenizer worker's `HubLink`); the HTTP handler reads a state's
outputs with `stream` (or `collect`).  With `--dp-size` ranks, a `RankPicker`
picks each request's rank; its abort goes to that rank.
As one of several tokenizer workers it stamps its `worker` id on what it sends, so its
rids' outputs come back to it.  A rid leaves
`rid_to_state` when it finishes or when its client goes away (`abort`, which also
reaches the Scheduler to free its KV).  Outputs arriving for a rid no longer there are
dropped and counted by reason.

It owns no socket: an `EngineTransport` (real ZMQ, or an in-memory one in unit tests)
carries its messages.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import Any, AsyncIterator, Callable

from protocol.io_struct import (
    AbortReq,
    BarrierReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    DetokParams,
    FlushCacheReq,
    FlushCacheReqOutput,
    Logprobs,
    Message,
    Ready,
    ReqMeta,
    Stamps,
    StepTimelineOutput,
    StepTimelineReq,
    StrOut,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from protocol.reasons import AbortReason
from serving.args import ServerArgs
from serving.frontend.engine_state import EngineState, FrontCounts, check_available
from serving.frontend.errors import bad_request, http_status
from serving.frontend.tenants.gate import TenantGate, refused
from serving.frontend.tenants.keys import TenantPolicy
from serving.frontend.tenants.namespace import cache_namespace, check_salt
from serving.frontend.tenants.priority import engine_priority
from serving.frontend.tokenizer_manager import embeddings
from serving.frontend.tokenizer_manager.admission import Admission
from serving.frontend.tokenizer_manager.rank_picker import RankPicker
from serving.frontend.tokenizer_manager.replies import RankReplies, combine_flushes
from serving.frontend.tokenizer_manager.req_state import Collected, GenerateReqInput, ReqState, join_logprobs
from serving.frontend.tokenizer_manager.tokenization import InputLimits, PromptTokenizer, check_size, check_tokens
from serving.frontend.tokenizer_manager.transport import EngineTransport
from serving.ipc import DropCounter
from serving.ratelog import RateLimitedLog
from telemetry.clock import now_ns
from telemetry.request_telemetry import RequestTelemetry

log = logging.getLogger(__name__)
_RID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
PROMPT_TAIL = 5  # prompt tokens the Detokenizer decodes the first output token against


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        transport: EngineTransport,
        tokenizer: Any,
        engine: EngineState,
        telemetry: RequestTelemetry,
        worker: int = 0,
        tenants: TenantGate | None = None,
        policy: Any = None,
    ) -> None:
        self.args = args
        self.worker = worker
        self.tenants = tenants  # per-tenant limits (None: none), decided for the whole server
        self.policy = policy or (lambda tenant: TenantPolicy())  # a tenant's priority and limits (the keys)
        self.rank_picker = RankPicker(args.dp_size)
        self.tel = telemetry
        self.tokenizer = tokenizer
        self.prompts = PromptTokenizer(tokenizer, args)
        self.transport = transport
        self.engine = engine
        self.admission = Admission(
            args.max_queued_requests, args.inflight_token_limit, engine.throughput.rate, telemetry.shed
        )
        self.drops = DropCounter("tokenizer_manager", on_drop=telemetry.tracing.stale_drop)
        self.handling_errors = RateLimitedLog(log)
        self.rid_to_state: dict[str, ReqState] = {}
        self.finished_total = 0
        self._flushes: dict[str, RankReplies] = {}  # awaiting every rank's reply
        self._timelines: dict[str, RankReplies] = {}  # the same, for GET /debug/timeline
        self._barriers: dict[str, RankReplies] = {}  # POST /debug/barrier: every rank's marker, on each path

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self.transport.start(self.on_message)

    async def close(self) -> None:
        await self.transport.close()
        self.prompts.close()

    def reset_engine(self) -> None:
        """The children are being replaced: forget what they said; drop messages queued for the dead one."""
        self.engine.reset()
        self.transport.reconnect()

    def has_in_flight(self) -> bool:
        return bool(self.rid_to_state)

    def engine_failed(self, message: str) -> None:
        """The engine died: every in-flight request ends with `message`; the new one starts clean."""
        self.abort_all(AbortReason.ENGINE_FAILURE, message)
        self.reset_engine()

    def oldest_arrival(self) -> int | None:
        return min((s.arrival for s in self.rid_to_state.values()), default=None)

    def counts(self) -> FrontCounts:
        return FrontCounts(
            self.drops.snapshot(),
            self.transport.codec.undecodable,
            self.handling_errors.count,
            self.oldest_arrival(),
            self.tel.gaps.snapshot() if self.tel.gaps is not None else [],
        )

    # -- receiving ------------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        """One message from a child (or the hub): outputs are handled here, the rest by the EngineState."""
        try:
            if isinstance(msg, BatchStrOutput):
                self._handle_str_output(msg)
                return
            if isinstance(msg, BatchEmbeddingOutput):
                self._handle_embedding_output(msg)
                return
            if isinstance(msg, FlushCacheReqOutput):
                pending = self._flushes.get(msg.id)
                if pending is None or pending.done.done():  # its caller timed out, or an engine restart
                    self.drops.drop("FlushCacheReqOutput", msg.id, {})
                else:
                    pending.add(msg.dp_rank, msg)
                return
            if isinstance(msg, StepTimelineOutput):
                waiting = self._timelines.get(msg.id)
                if waiting is not None:  # else its caller timed out
                    waiting.add(msg.dp_rank, msg)
                return
            if isinstance(msg, BarrierReq):
                waiting = self._barriers.get(msg.id)
                if waiting is not None:
                    waiting.add((msg.dp_rank, msg.path), msg)
                return
            applied = self.engine.handle(msg)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the loop
            self.handling_errors.report(f"failed to handle {type(msg).__name__}", exc)
            return
        if not applied:  # not for the TM (None), or a Ready refused (False): counted as unexpected
            self.transport.codec.undecodable += 1
            if applied is None:
                log.warning("unexpected %s on a TokenizerManager socket", type(msg).__name__)

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
                self.abort(out.rid, AbortReason.INTERNAL_ERROR, "internal error while handling this request's output")
            state.event.set()

    def _apply_output(self, state: ReqState, out: StrOut, recv: int) -> None:
        state.out_list.append(out)
        state.meta = out.meta
        state.completion_tokens = out.completion_tokens
        state.cached_tokens = max(state.cached_tokens, out.cached_tokens)
        state.retractions = max(state.retractions, out.retractions)
        state.speculative = out.speculative or state.speculative
        state.cpu_ns = max(state.cpu_ns, out.cpu_ns)
        self._started(state)
        self.tel.on_output(state, out, recv)
        if state.parsing is not None:
            state.parsing.feed(out.text, len(out.output_ids))
        if out.finish_reason is not None:
            self.forget(state, out.finish_reason, out.abort_reason, out.error)
            if out.abort_in_engine:  # the Detokenizer ended it (a stop string, or it failed there)
                self._send_abort(
                    state, AbortReason.STOP_STRING if out.finish_reason == "stop" else AbortReason.DETOKENIZER_ERROR
                )

    def _handle_embedding_output(self, batch: BatchEmbeddingOutput) -> None:
        """Each `EmbeddingOut` finishes its request (one message, the whole answer)."""
        for out in batch.outputs:
            state = self.rid_to_state.get(out.rid)
            if state is None:
                self.drops.drop("BatchEmbeddingOutput", out.rid, out.meta.trace)
                continue
            state.meta, state.embedding = out.meta, out
            state.cached_tokens, state.cpu_ns = out.cached_tokens, out.cpu_ns
            self._started(state)
            self.forget(state, "stop", None, None)
            state.event.set()

    def _started(self, state: ReqState) -> None:
        """Its first output arrived: it no longer counts as queued."""
        if not state.started:
            state.started = True
            self.admission.started()

    def forget(self, state: ReqState, reason: str, abort_reason: str | None, error: str | None) -> None:
        """Every ending's one path: the rid leaves rid_to_state, marked, counted and observed (exactly once).
        A chat answer read for tool calls finishes as the client is told (`tool_calls`), the engine's reason
        aside."""
        told = state.parsing.finish(reason) if state.parsing is not None else reason
        state.finished, state.finish_reason = True, told
        state.status = http_status(told, abort_reason)
        self.rid_to_state.pop(state.rid, None)
        self.finished_total += 1
        self.admission.release(state.budget_tokens, state.started)
        if self.tenants is not None:
            self.tenants.release(state.tenant, state.rid, state.completion_tokens)
        self.rank_picker.release(state.dp_rank, state.budget_tokens)
        if state.timer is not None:
            state.timer.cancel()
        self.drops.forget(state.rid, abort_reason or reason)
        state.breakdown = self.tel.finish(state, told, abort_reason, error)

    # -- submitting -------------------------------------------------------------------
    def _options(self, obj: GenerateReqInput | embeddings.EmbedReqInput, state: ReqState) -> tuple[str, int]:
        """The request's cache namespace and engine priority (400 on a bad salt or priority)."""
        check_salt(obj.cache_salt)
        namespace = cache_namespace(self.args.prefix_cache_sharing, state.tenant, obj.cache_salt)
        tenant = self.policy(state.tenant)
        if obj.priority is not None and not -1000 <= obj.priority <= 1000:
            raise bad_request("priority must be an integer in [-1000, 1000]", param="priority")
        return namespace, engine_priority(self.args.priority_order, tenant.priority, obj.priority)

    async def submit(self, obj: GenerateReqInput, state: ReqState) -> ReqState:
        """Tokenize, validate and send; raises APIError (4xx/503) before anything is sent."""
        ready = check_available(self.engine, self.oldest_arrival())
        if ready.embedding_only:
            raise bad_request(
                "this is an embedding model: it serves POST /v1/embeddings and /encode, not generation",
                code="generation_not_supported",
            )
        _check_rid(obj.rid)
        namespace, priority = self._options(obj, state)
        self.admission.check_queue()
        check_size(obj, ready.context_len, self.input_limits(ready))
        if obj.constraints:  # a spec that cannot compile is a 400 here, never an engine step
            await self.prompts.grammar.check(obj.constraints)
        t0 = now_ns()
        ids = await self.prompts.encode(obj, ready.vocab_size)
        t1 = now_ns()
        # the engine may have been replaced, paused or stopped while this request was tokenized
        ready = check_available(self.engine, self.oldest_arrival())
        check_tokens(obj, ids, ready)
        if obj.echo or obj.sampling.prompt_logprobs is not None:
            state.prompt_ids = ids
        state.param_sources = obj.param_sources
        detok = DetokParams(
            stop=obj.stop,
            skip_special_tokens=obj.skip_special_tokens,
            prompt_tail=ids[-PROMPT_TAIL:],
            include_stop_str_in_output=obj.include_stop_str_in_output,
        )
        budget = self.args.expected_tokens(len(ids), obj.sampling.max_new_tokens)  # what the Scheduler first expects
        return await self._admit_and_send(
            state,
            obj.rid,
            obj.timeout,
            ids,
            len(ids),
            budget,
            namespace,
            (t0, t1),
            lambda rid, meta: TokenizedGenerateReqInput(
                rid=rid,
                input_ids=ids,
                sampling=obj.sampling,
                detok=detok,
                meta=meta,
                worker=self.worker,
                priority=priority,
                cache_namespace=namespace,
            ),
        )

    async def submit_embeddings(self, obj: embeddings.EmbedReqInput, state: ReqState) -> ReqState:
        """`submit` for an embeddings request: every input tokenized, one message for all of them."""
        _check_rid(obj.rid)
        ready = check_available(self.engine, self.oldest_arrival())
        embeddings.check(obj, ready, self.args.max_embedding_inputs)
        namespace, priority = self._options(obj, state)
        self.admission.check_queue()
        t0 = now_ns()
        inputs = await embeddings.tokenize(self.prompts, obj, ready, self.input_limits(ready).max_chars)
        t1 = now_ns()
        ready = check_available(self.engine, self.oldest_arrival())
        tokens = sum(map(len, inputs))
        state.embed_inputs = len(inputs)
        return await self._admit_and_send(
            state,
            obj.rid,
            obj.timeout,
            inputs[0],
            tokens,
            tokens,
            namespace,
            (t0, t1),
            lambda rid, meta: TokenizedEmbeddingReqInput(
                rid=rid,
                inputs=inputs,
                pooling=ready.pooling,
                meta=meta,
                worker=self.worker,
                priority=priority,
                cache_namespace=namespace,
            ),
        )

    async def _admit_and_send(
        self,
        state: ReqState,
        client_rid: str | None,
        timeout: float | None,
        first_ids: list[int],
        prompt_tokens: int,
        budget: int,
        namespace: str,
        tokenize_ns: tuple[int, int],
        message: Callable[[str, ReqMeta], Message],
    ) -> ReqState:
        """Admit a tokenized request (429 when full, the tenant's limits) and send it to the rank picked for it.

        The internal rid is always fresh (a client's `rid` is only echoed back): a client reusing its rid
        right after a disconnect must never receive the old request's late outputs or abort.
        """
        rid = uuid.uuid4().hex
        self.admission.check_queue()  # others may have been admitted while this one was tokenized
        self.admission.check_tokens(budget, others_in_flight=bool(self.rid_to_state))
        if self.tenants is not None and (refusal := await self.tenants.acquire(state.tenant, rid, prompt_tokens)):
            self.tel.shed(f"tenant_{refusal.limit}")
            raise refused(refusal)
        state.rid, state.client_rid = rid, client_rid or rid
        state.prompt_tokens, state.budget_tokens = prompt_tokens, budget
        self.tel.tokenized(state, *tokenize_ns)
        carrier, producer = self.tel.producer(state)
        state.meta = ReqMeta(trace=carrier, stamps=Stamps(arrival=state.arrival, tokenized=now_ns()))
        self.rid_to_state[rid] = state
        self.admission.admit(budget)
        state.dp_rank = self.rank_picker.pick(first_ids, budget, namespace)
        if timeout:
            state.timer = asyncio.get_running_loop().call_later(
                timeout, self.abort, rid, AbortReason.TIMEOUT, f"the request timed out after {timeout:g} s"
            )
        self.transport.send(message(rid, state.meta), state.dp_rank)
        if producer is not None:
            producer.end()
        return state

    def input_limits(self, ready: Ready) -> InputLimits:
        return InputLimits.for_context(ready.context_len, self.args.max_prompt_chars, self.args.max_messages)

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
                self.abort(state.rid, AbortReason.CLIENT_DISCONNECT)

    async def collect(self, state: ReqState) -> Collected:
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[Logprobs] = []
        prompt_logprobs: Logprobs | None = None
        last: StrOut | None = None
        async for out in self.stream(state):
            text.append(out.text)
            ids.extend(out.output_ids)
            if out.logprobs is not None:
                logprobs.append(out.logprobs)
            prompt_logprobs = prompt_logprobs or out.prompt_logprobs
            last = out
        if last is None:  # aborted before any output (shutdown, engine failure)
            return Collected(state.client_rid, "", [], "error", None, state.prompt_tokens, 0, "the request was aborted")
        return Collected(
            state.client_rid,
            "".join(text),
            ids,
            last.finish_reason,
            last.matched_stop,
            state.prompt_tokens,
            last.completion_tokens,
            last.error,
            state.cached_tokens,
            join_logprobs(logprobs),
            prompt_logprobs,
        )

    async def flush_cache(self, force: bool, timeout: float = 10.0) -> FlushCacheReqOutput:
        """Ask every Scheduler rank to empty its prefix cache; one reply for all (a success when every rank
        flushed); raises TimeoutError when one does not answer."""
        fid = uuid.uuid4().hex
        pending = self._flushes[fid] = RankReplies(self.args.dp_size, combine_flushes)
        try:
            for rank in range(self.args.dp_size):
                self.transport.send(FlushCacheReq(id=fid, force=force, worker=self.worker), rank)
            return await asyncio.wait_for(pending.done, timeout)
        finally:
            del self._flushes[fid]

    async def step_timeline(self, seconds: float, timeout: float = 10.0) -> list[StepTimelineOutput]:
        """Every Scheduler rank's steps of the last `seconds`, by rank; raises TimeoutError when one does not
        answer."""
        tid = uuid.uuid4().hex
        pending = self._timelines[tid] = RankReplies(self.args.dp_size)
        try:
            for rank in range(self.args.dp_size):
                self.transport.send(StepTimelineReq(id=tid, seconds=seconds, worker=self.worker), rank)
            return await asyncio.wait_for(pending.done, timeout)
        finally:
            del self._timelines[tid]

    async def barrier(self, timeout: float = 10.0) -> int:
        """Push a marker through every rank's Scheduler → Detokenizer → here and wait for it on the output
        path and both control paths: what the children sent before it (outputs, stats) has then been
        handled.  Returns the number of ranks; raises TimeoutError when one does not answer."""
        bid = uuid.uuid4().hex
        pending = self._barriers[bid] = RankReplies(3 * self.args.dp_size)  # output, control, detokenizer
        try:
            for rank in range(self.args.dp_size):
                self.transport.send(BarrierReq(id=bid, worker=self.worker), rank)
            await asyncio.wait_for(pending.done, timeout)
            return self.args.dp_size
        finally:
            del self._barriers[bid]

    def broadcast(self, msg: Message) -> None:
        """One control message (pause, continue, log level) to every Scheduler rank."""
        for rank in range(self.args.dp_size):
            self.transport.send(msg, rank)

    def abort(self, rid: str, reason: str, error: str | None = None) -> None:
        """Forget the rid here and tell the Scheduler to free it; the reader gets `error` if given."""
        state = self.rid_to_state.get(rid)
        if state is None:
            return
        if error is not None:
            state.out_list.append(
                StrOut(
                    rid=rid,
                    text="",
                    output_ids=[],
                    finish_reason="abort",
                    error=error,
                    abort_reason=reason,
                    prompt_tokens=state.prompt_tokens,
                    completion_tokens=state.completion_tokens,
                    meta=state.meta,
                )
            )
        self.forget(state, "abort", reason, error)
        state.event.set()
        self._send_abort(state, reason)

    def abort_all(self, reason: str, message: str) -> None:
        """End every in-flight request with an explicit error (shutdown, engine failure, an operator's
        pause in mode abort)."""
        for rid in list(self.rid_to_state):
            self.abort(rid, reason, error=message)

    def _send_abort(self, state: ReqState, reason: str) -> None:
        self.transport.send(AbortReq(rid=state.rid, reason=reason, meta=state.meta), state.dp_rank)


def _check_rid(rid: str | None) -> None:
    if rid is not None and not _RID.match(rid):
        raise bad_request("rid must be 1-128 characters [A-Za-z0-9._:-]", param="rid")
