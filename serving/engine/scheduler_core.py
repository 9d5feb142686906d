"""The engine the Scheduler process drives: continuous batching over the paged KV pool.

Usable in-process (tests, benchmarks): `add_request`, then `step()` until idle.
Each step:
  1. every running request whose prompt is done decodes one token;
  2. if the KV available (free or evictable) would not give every decoding request its
     next slot, requests are retracted (`serving.engine.retraction`, --admission estimate
     only): they leave the batch, their K/V stays in the prefix cache, pinned, and they go
     back to the head of the queue, to resume after the tokens they already have;
  3. prompts are prefilled under a per-step budget (`serving.engine.batch_builder`: all of
     `max_prefill_tokens` when nothing decodes, else what `max_step_tokens` and the step's
     time budget (`serving.engine.step_budget`) leave after the decodes, at least
     `min_prefill_chunk`): first the chunk in progress, then
     waiting requests in arrival order, chunking the one that does not fit; a request
     is admitted when the admission policy (`serving.engine.admission`) finds its
     expected KV need and the running requests' fit, and fewer than
     `max_running_requests` run.  A step that retracted admits no one;
  4. one ragged forward runs decodes and prefill chunks side by side (`serving.engine.forward_pass`);
  5. requests whose prompt is complete sample a token (through their grammar's mask, if they
     have one: `serving.engine.grammar`); finished ones free KV at once.

With --speculative, decoding requests get drafts after step 3 within what the step leaves, are
verified in the step's forward and may append several tokens (`serving.engine.speculation`).

A request with a structured output waits (reason `grammar`) until its grammar is compiled, off
the step loop; admission passes over it meanwhile.

A resumed request computes again what the cache no longer holds of its prompt and its
output, then samples its next token from the same generator state, so it produces the
tokens it would have produced had it never left.  Which slots a request holds, and the
prefix cache's locks and pins, are the cache manager's (`serving.engine.cache_manager`);
see `check_kv_invariants` for the accounting.

An encoder model (BERT, `ModelRunner.encoder`) serves embeddings only: its inputs attend
bidirectionally, so each is admitted only when it fits the step whole (never chunked; it
waits for a step with room), and there is no prefix cache.

One request must never fail another: if the step raises, its K/V allocation is undone
(positions count as computed only after a success) and the batch is split in halves,
recursively, until each failing request stands alone; those end with finish_reason
`error`, every other request gets its token as if nothing happened.  A healthy step pays
nothing for this.

`step` reads schedule → run → emit: `_schedule` (steps 1–3), `ForwardPass.run_isolated` (4),
`_emit` (5, and the step's plain record, `last_step`).

Fault injection (tests): SIGHTLINE_FAULT_SEED (`serving.engine.forward_pass`).  The
hold seam (`serving.engine.seams`) keeps a request marked by its seed running one token
short of its limit: it is left out of the decodes and of retraction until released or cut.  The
admission-stop seam admits no new request while the request marked by its seed runs.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from protocol.io_struct import Logprobs
from protocol.reasons import FinishReason
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine.admission import AdmissionPolicy
from serving.engine.batch_builder import BatchBuilder
from serving.engine.cache_manager import CacheManager
from serving.engine.embedding import PoolState
from serving.engine.events import StepStats, TokenEvent
from serving.engine.forward_pass import ForwardPass, Produced
from serving.engine.grammar import Grammars
from serving.engine.kv_invariants import check_kv_invariants
from serving.engine.loader import LoadedModel
from serving.engine.model_runner import ModelRunner
from serving.engine.radix_cache import RadixCache
from serving.engine.request import Req, ReqStatus
from serving.engine.retraction import Retractions
from serving.engine.seams import Seams
from serving.engine.speculation import Speculator
from serving.engine.stopping import eos_ids, finish_reason
from serving.engine.wait_queue import WaitQueue
from serving.model_errors import ModelLoadError
from serving.ratelog import RateLimitedLog
from telemetry.buckets import DEFAULT_BUCKETS, parse_bucket_overrides
from telemetry.clock import now_ns

log = logging.getLogger(__name__)
COMPILE_POLL_S = 0.005  # an idle step waits this long at most for a grammar compile


@dataclass
class StepPlan:
    """What a step will run (`SchedulerCore._schedule`): its decodes and prefill chunks, the requests retracted
    to make room for them, and those that ended before it ran (a grammar that failed to compile)."""

    decoding: list[Req]
    chunks: list[tuple[Req, int]]
    retracted: list[Req]
    ended: list[TokenEvent]
    group: list[tuple[Req, int]] = field(init=False)  # (request, tokens to feed): the decodes, then the chunks

    def __post_init__(self) -> None:
        self.group = [(r, 1) for r in self.decoding] + self.chunks


class SchedulerCore:
    def __init__(self, loaded: LoadedModel, args: ServerArgs) -> None:
        self.args = args
        self.runner = ModelRunner(loaded, args)
        self.pool = self.runner.pool
        self.context_len = self.runner.context_len
        self.vocab_size = self.runner.vocab_size
        self.eos_ids = eos_ids(loaded)
        self.waiting = WaitQueue()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._seed_rng = random.Random(args.random_seed)
        self.last_step = StepStats()
        self.seams = Seams.from_env()
        self.failed_requests = 0  # cumulative: requests the engine failed alone
        self.fail_log = RateLimitedLog(log)
        self.encoder = self.runner.encoder
        # an encoder's hidden states depend on the whole input: no prefix of it can be reused
        self.tree: RadixCache | None = None if args.disable_prefix_cache or self.encoder else RadixCache()
        self.cache = CacheManager(self.pool, self.tree)
        self.policy = AdmissionPolicy.from_args(args)
        stage = {**DEFAULT_BUCKETS, **parse_bucket_overrides(args.histogram_buckets)}["stage"]
        self.grammar = Grammars(loaded.path, self.eos_ids, self.vocab_size, stage)  # no thread until a grammar
        if args.speculative != "off" and self.encoder:
            raise ModelLoadError(
                f"--speculative {args.speculative} needs a generative model; {loaded.name} is an encoder"
            )
        self.spec = Speculator.from_args(args, loaded, self.runner.precision.quantization)  # None: off
        self.forward = ForwardPass(self.runner, self.grammar, args, self.eos_ids, self.spec)
        self.retraction = Retractions(args, self.cache, self.policy)
        self.batches = BatchBuilder(args, self.cache, self.policy, self.encoder)
        self.cache_flushes = 0  # cumulative (telemetry)

    # -- intake ---------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        namespace: str = "",
        pooling: str | None = None,
    ) -> Req:
        """Queue a request (an embedding one, prefill only, with `pooling`); raises ValueError (a client error)
        when it can never run."""
        if rid in self.reqs:
            raise ValueError(f"duplicate request id {rid!r}")
        if not input_ids:
            raise ValueError("prompt is empty")
        if pooling is None and self.encoder:
            raise ValueError("this model is an encoder: it serves embeddings only")
        if pooling is not None and len(input_ids) > self.context_len:
            raise ValueError(f"input has {len(input_ids)} tokens; the context window is {self.context_len}")
        if pooling is None and len(input_ids) >= self.context_len:
            raise ValueError(
                f"prompt has {len(input_ids)} tokens; the context window is {self.context_len} "
                "and at least one token must be generated"
            )
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Req(
            rid=rid,
            input_ids=list(input_ids),
            params=params,
            generator=torch.Generator().manual_seed(seed),
            stop_ids=frozenset(params.stop_token_ids),
            priority=priority,
            namespace=namespace,
            hold=self.seams.holds(params.seed),
        )
        req.max_new_tokens = min(params.max_new_tokens, self.context_len - len(input_ids))
        if pooling is not None:
            req.pooling, req.max_new_tokens = PoolState(pooling), 0
        elif params.prompt_logprobs is not None:
            req.prompt_logprobs = Logprobs(token_logprobs=[])
        if pooling is None and params.structured is not None:
            req.grammar = self.grammar.start(req, req.times.queued)
        if self.spec is not None:
            self.spec.attach(req)
        self.reqs[rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: str) -> TokenEvent | None:
        """Abort at any stage, freeing KV at once; None when the rid is unknown (already gone)."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, FinishReason.ABORT)
        return TokenEvent(rid, [], FinishReason.ABORT, req)

    # -- state ------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Something to step: a waiting request, or a running one that is not held (`num_held`)."""
        if self.seams.hold_seed is None:  # the usual case: no request can be held
            return bool(self.waiting or self.running)
        return bool(self.waiting) or any(not r.held for r in self.running)

    @property
    def num_held(self) -> int:
        return sum(r.held for r in self.running)

    def release(self, rids: list[str]) -> int:
        """Let held-marked requests finish (every one when `rids` is empty); how many were marked."""
        reqs = [self.reqs[r] for r in rids if r in self.reqs] if rids else list(self.reqs.values())
        marked = [r for r in reqs if r.hold]
        for req in marked:
            req.hold = False
        return len(marked)

    @property
    def retractions(self) -> int:
        """Cumulative: requests taken out of the batch."""
        return self.retraction.total

    @property
    def retracted_tokens(self) -> int:
        """Cumulative: the K/V positions the retracted requests had."""
        return self.retraction.tokens

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def prefix_cached_tokens(self) -> int:
        """KV slots the prefix cache holds (locked by running requests or not)."""
        return self.pool.tree_slots

    @property
    def prefix_evicted_tokens(self) -> int:
        """Cumulative: cached slots evicted to make room for new K/V."""
        return self.pool.evicted_slots

    @property
    def kv_committed(self) -> int:
        """KV slots the running requests hold plus what the admission policy expects them to allocate."""
        return self.pool.in_use + round(self.policy.committed(self.running))

    def stats(self) -> dict[str, object]:
        """The engine's part of `SchedulerStats`, by field name: its queues, its KV pool and admission estimate,
        its latest step, its prefix-cache and retraction counters.  The Scheduler process adds its own."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "held": self.num_held,
            **self.pool.stats(),
            "kv_reserved": self.kv_committed,
            "new_token_ratio": self.policy.ratio,
            **self.last_step.stats(),
            **self.batches.timing.stats(),
            **self.grammar.stats(),
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "prefix_queries_tokens_total": self.batches.prefix_queries_tokens,
            "prefix_hits_tokens_total": self.batches.prefix_hits_tokens,
            "prefix_evicted_tokens_total": self.prefix_evicted_tokens,
            "retractions_total": self.retractions,
            "retracted_tokens_total": self.retracted_tokens,
            "retraction_recomputed_tokens_total": self.batches.recomputed_tokens,
            "admissions_total": self.batches.admissions,
            "prefix_evictable_tokens": self.tree.evictable_slots if self.tree is not None else 0,
            **(self.spec.stats() if self.spec is not None else Speculator.off_stats()),
        }

    def flush_cache(self, force: bool = False) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run, unless `force`.

        Idle, every tree slot goes back to the free stack (the pool `is_empty()`).  Forced
        while requests run, only the unlocked nodes go: the prefixes running requests reuse
        stay until they finish.  Waiting requests lock nothing and do not block a flush; a
        retracted one then recomputes what it had.
        """
        if self.running and not force:
            return False
        self.cache.flush()
        self.cache_flushes += 1
        return True

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Run one batch: schedule it, run it, emit what it produced (the new tokens and finishes, and the
        step's record in `last_step`)."""
        t0 = now_ns()
        plan = self._schedule()
        if not plan.group:
            self.last_step = StepStats(num_retracted=len(plan.retracted))
            return plan.ended
        t_sched = now_ns()
        self.forward.reset()
        starts = tuple(r.num_computed for r, _ in plan.group)
        fed = tuple(n + len(r.spec.draft) if r.spec is not None else n for r, n in plan.group)
        produced, failed = self.forward.run_isolated(plan.group)
        return self._emit(plan, produced, failed, t0, t_sched, starts, fed)

    def _schedule(self) -> StepPlan:
        """Steps 1–3: grammars compiled (or failed), room made by retraction, prompts admitted and chunked."""
        self.batches.timing.observe(self.last_step)  # the previous step's cost, for this one's time budget
        ended = self._grammars_compiled() if self.grammar.live else []
        retracted = self.retraction.make_room(self.running, self.waiting)
        decoding = [r for r in self.running if r.prefill_done and not r.held]
        admit_new = not retracted and not self.seams.stops_admission(self.running)
        chunks = self.batches.admit(self.running, self.waiting, len(decoding), admit_new=admit_new)
        if self.spec is not None:  # drafts in what the step leaves of the KV and of its token budget
            step_tokens = len(decoding) + sum(n for _, n in chunks)
            self.spec.propose(decoding, self.cache.available - step_tokens, step_tokens)
        if not retracted:
            self.policy.stepped(decoded=bool(decoding))
        return StepPlan(decoding, chunks, retracted, ended)

    def _emit(
        self,
        plan: StepPlan,
        produced: list[Produced],
        failed: list[tuple[Req, Exception]],
        t0: int,
        t_sched: int,
        starts: tuple[int, ...],
        fed: tuple[int, ...],
    ) -> list[TokenEvent]:
        """Step 5: the prefill chunks that ran given to the prefix cache, every produced token appended (finishes
        freeing KV at once), every failed request ended alone; the step's record in `last_step`."""
        t1 = now_ns()
        failed_ids = {id(r) for r, _ in failed}
        for req, n in plan.chunks:
            if id(req) not in failed_ids:
                req.times.prefill_chunks.append((t0, t1, n))
                if self.tree is not None:  # a request arriving now reuses what this one computed
                    self.cache.give_to_tree(req, keep_lock=True)
        events = plan.ended + [self._fail(req, exc) for req, exc in failed]
        fp = self.forward
        run_grammar_ns = fp.grammar_ns
        events += self._append_runs(produced, t1)
        t2 = now_ns()
        consume_ns = fp.grammar_ns - run_grammar_ns  # inside t1..t2: not the sample phase's
        group, chunks = plan.group, plan.chunks
        self.last_step = StepStats(
            batch_size=len(group),
            num_decode=len(plan.decoding),
            num_prefill_tokens=sum(n for _, n in chunks),
            num_prefill_reqs=len(chunks),
            step_seconds=(t1 - t0) / 1e9,
            schedule_seconds=(t_sched - t0) / 1e9,
            forward_seconds=fp.forward_ns / 1e9,
            sample_seconds=(fp.sample_ns + t2 - t1 - consume_ns) / 1e9,
            verify_seconds=fp.verify_ns / 1e9,
            logprobs_seconds=fp.logprobs_ns / 1e9,
            grammar_seconds=fp.grammar_ns / 1e9,
            started_ns=t0,
            ended_ns=t1,
            rids=tuple(r.rid for r, _ in group),
            num_retracted=len(plan.retracted),
            prefill_rids=tuple(r.rid for r, _ in chunks),
            tokens=fed,
            starts=starts,
            num_sampled=len({id(r) for r, _, _ in produced}),
        )
        return events

    def _fail(self, req: Req, exc: Exception) -> TokenEvent:
        """End one request the engine could not serve; its batch mates are unaffected."""
        self.failed_requests += 1
        self.fail_log.report(f"request {req.rid[:64]!r} failed in the engine step and was ended alone", exc)
        req.error = "internal engine error while serving this request"
        self.running.remove(req)
        self._finish(req, FinishReason.ERROR)
        return TokenEvent(req.rid, [], FinishReason.ERROR, req, error=req.error)

    def _grammars_compiled(self) -> list[TokenEvent]:
        """Waiting requests whose grammar compiled can be admitted from now; those whose compile failed end
        here with its error.  With nothing running and only compiles to wait for, wait for one (briefly)."""
        if not self.running and len(self.grammar.pending) == len(self.waiting):
            self.grammar.wait(COMPILE_POLL_S)
        events = []
        for req, error in self.grammar.poll(now_ns()):
            self.waiting.remove(req)
            events.append(self._end_with_error(req, error))
        return events

    def _end_with_error(self, req: Req, error: str) -> TokenEvent:
        """End one request because of what it asked for (its grammar): an error it is told, batch mates untouched."""
        log.debug("request %r ended: %s", req.rid[:64], error)
        req.error = error
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        self._finish(req, FinishReason.ERROR)
        return TokenEvent(req.rid, [], FinishReason.ERROR, req, error=error)

    def _append_runs(self, produced: list[Produced], t: int) -> list[TokenEvent]:
        """Every produced token appended in order, one event per request: a verified request's run of tokens
        is one event, cut where one of them ended it (the rest is dropped)."""
        events: list[TokenEvent] = []
        for req, tok, lp in produced:
            if req.status is ReqStatus.FINISHED:  # ended inside its run
                continue
            ev = self._append_token(req, tok, t, lp)
            if events and events[-1].req is req:
                events[-1].new_token_ids += ev.new_token_ids
                events[-1].finish_reason = ev.finish_reason
            else:
                events.append(ev)
        return events

    def _append_token(self, req: Req, tok: int, t: int, lp: Logprobs | None = None) -> TokenEvent:
        if req.pooling is not None:  # its prompt has run: the embedding is its result
            req.embedding, req.times.first_token = req.pooling.result(), t
            self.running.remove(req)
            self._finish(req, FinishReason.STOP)
            return TokenEvent(req.rid, [], FinishReason.STOP, req)
        if req.grammar is not None:
            t0 = now_ns()
            error = self.grammar.advance(req, tok)
            self.forward.grammar_ns += now_ns() - t0
            if error is not None:
                return self._end_with_error(req, error)
        req.output_ids.append(tok)
        req.times.token_times.append(t)
        if req.times.first_token is None:
            req.times.first_token = t
        reason = finish_reason(req, tok, self.eos_ids)
        if reason is None and req.grammar is not None and req.grammar.complete:
            reason = FinishReason.STOP  # the grammar is done: nothing may follow
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)
        return TokenEvent(req.rid, [tok], reason, req, logprobs=lp)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        if req.grammar is not None:
            self.grammar.release(req)
        if req.spec is not None:
            self.spec.finished(req)
        self.cache.release(req, cache=reason is not FinishReason.ERROR)  # a failed step may have left bad K/V
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.times.finished = now_ns()
        if req.times.waiting_since is not None:  # aborted in the queue: the interval ends here
            req.times.waits.append((req.times.waiting_since, req.times.finished))
            req.times.wait.close(req.times.finished, req.times.waiting_since)
            req.times.waiting_since = None
        del self.reqs[req.rid]

    # -- accounting checks (tests) ------------------------------------------------
    def check_kv_invariants(self) -> None:
        """Raise AssertionError unless the KV bookkeeping is consistent (call between steps)."""
        check_kv_invariants(self.pool, self.running, self.waiting, self.policy)

    # -- convenience --------------------------------------------------------------
    def run_to_completion(self, max_steps: int = 1_000_000) -> list[TokenEvent]:
        """Step until idle (tests, benchmarks); returns every event in order."""
        events: list[TokenEvent] = []
        for _ in range(max_steps):
            if not self.has_work:
                return events
            events.extend(self.step())
        raise RuntimeError("engine did not go idle")
