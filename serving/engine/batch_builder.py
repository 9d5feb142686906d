"""Which prompts join this step's batch, and how much of each (step 3 of `SchedulerCore.step`).

Prompts are prefilled under a per-step budget (`prefill_budget`: tokens, and time while requests decode,
`serving.engine.step_budget`): first the chunk in progress, then
waiting requests in arrival order, chunking the one that does not fit.  A request is admitted when the
admission policy (`serving.engine.admission`) finds its expected KV need and the running requests' fit,
and fewer than `max_running_requests` run; a step that retracted admits no one.  A request whose grammar
is still compiling is passed over (it holds back no one); an encoder's input is admitted only whole.
Why the head of the queue stays there is assigned to every waiting request (`serving.engine.wait_reasons`).
"""

from __future__ import annotations

from serving.args import ServerArgs
from serving.engine.admission import AdmissionPolicy
from serving.engine.cache_manager import CacheManager
from serving.engine.request import Req, ReqStatus
from serving.engine.step_budget import StepBudget
from serving.engine.wait_queue import WaitQueue
from serving.engine.wait_reasons import KV_CAPACITY, RETRACTED, RUNNING_LIMIT, STEP_BUDGET, assign
from telemetry.clock import now_ns


class BatchBuilder:
    def __init__(self, args: ServerArgs, cache: CacheManager, policy: AdmissionPolicy, encoder: bool) -> None:
        self.args, self.cache, self.policy, self.encoder = args, cache, policy, encoder
        self.timing = StepBudget(args.step_time_factor, args.max_step_ms / 1e3)
        # cumulative counters (telemetry)
        self.prefix_queries_tokens = 0  # prompt tokens of admitted requests
        self.prefix_hits_tokens = 0  # of those, reused from the cache
        self.recomputed_tokens = 0  # retracted positions computed again when they resumed (the cache lost them)
        self.admissions = 0  # requests admitted into the batch, resumptions after a retraction included

    def prefill_budget(self, num_decoding: int, heading: int = 0) -> int:
        """Prompt tokens this step may prefill.

        Idle decoders: all of --max-prefill-tokens (time to first token is all that counts).
        With requests decoding, the step's tokens are capped at --max-step-tokens, decodes
        first, and its prefill at what fits in its time budget (`serving.engine.step_budget`),
        so a step's time — every decoding request's inter-token gap — stays bounded
        whatever prompts arrive (`heading`: the batch the queue is heading to, the step the
        budget is a multiple of); at least --min-prefill-chunk so waiting prompts progress,
        except in the rare step that runs its decodes alone to anchor the time budget.
        """
        a = self.args
        if not num_decoding:
            n = a.max_prefill_tokens
        elif self.timing.probe:  # the decodes alone, once in a while: the time budget's anchor
            n = 0
        else:
            n = a.max_step_tokens - num_decoding
            timed = self.timing.prefill_tokens(num_decoding, heading)
            if timed is not None:
                n = min(n, timed)
            n = min(a.max_prefill_tokens, max(a.min_prefill_chunk, n))
        self.timing.last_tokens = n
        return n

    def admit(
        self, running: list[Req], waiting: WaitQueue, num_decoding: int, admit_new: bool
    ) -> list[tuple[Req, int]]:
        """This step's prefill chunks: the one in progress first, then waiting requests in arrival order (moved
        to `running` as they are admitted) while the budget, the running limit and the KV allow."""
        heading = min(len(running) + len(waiting), self.args.max_running_requests)
        budget = self.prefill_budget(num_decoding, heading)
        chunks: list[tuple[Req, int]] = []
        room = self.cache.available - num_decoding  # slots this step's prefill may still allocate
        for req in running:  # a chunked prefill in progress goes first
            if not req.prefill_done and budget > 0 and room > 0:
                n = min(budget, room, req.prefill_len - req.num_computed)
                chunks.append((req, n))
                budget, room = budget - n, room - n
        committed = self.policy.committed(running) if admit_new else 0.0
        blocked = None if admit_new else RETRACTED  # why the head of the queue stays there (wait_reasons)
        i = 0  # the queue's head: the first request whose grammar (if any) is compiled
        while admit_new and i < len(waiting):
            if waiting[i].grammar_pending:  # it waits for its grammar, holding back no one
                i += 1
                continue
            if budget <= 0 or len(running) >= self.args.max_running_requests:
                blocked = STEP_BUDGET if budget <= 0 else RUNNING_LIMIT
                break
            req = waiting[i]
            match = self.cache.match(req)
            need = self.policy.need(req) - match.length  # it allocates only what the cache does not hold
            if committed + match.gain + need > self.cache.available:
                blocked = KV_CAPACITY
                break  # strict arrival order: no overtaking by smaller requests
            if self.encoder and req.prefill_len > min(budget, room):  # whole in one step, or not yet
                blocked = STEP_BUDGET if req.prefill_len > budget else KV_CAPACITY
                break
            del waiting[i]
            self.cache.attach(req, match)
            committed += need
            room -= match.gain
            self._admitted(req, match.length)
            running.append(req)
            n = min(budget, room, req.prefill_len - match.length)
            chunks.append((req, n))
            budget, room = budget - n, room - n
        assign(waiting, blocked, now_ns())
        return chunks

    def _admitted(self, req: Req, m: int) -> None:
        self.admissions += 1
        t, now = req.times, now_ns()
        t.waits.append((t.waiting_since or now, now))
        t.wait.close(now, t.waiting_since or now)
        t.waiting_since = None
        if t.scheduled is None:
            t.scheduled = now
            req.cached_tokens = m
            self.prefix_queries_tokens += req.prompt_len
            self.prefix_hits_tokens += m
        else:  # resumed after a retraction: what it had and the cache lost is computed again
            self.recomputed_tokens += max(0, req.retracted_computed - m)
        req.status = ReqStatus.RUNNING
