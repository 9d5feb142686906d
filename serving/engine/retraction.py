"""Retraction: when the KV available (free or evictable) would not give every decoding request its next
slot, requests leave the batch (--admission estimate only) in the admission policy's order.  Their K/V
stays in the prefix cache, pinned, and they go back to the head of the queue, to resume after the tokens
they already have (`SchedulerCore`'s admission computes again what the cache no longer holds)."""

from __future__ import annotations

from serving.args import ServerArgs
from serving.engine.admission import AdmissionPolicy
from serving.engine.cache_manager import CacheManager
from serving.engine.request import Req, ReqStatus, Retraction
from serving.engine.wait_queue import WaitQueue
from serving.engine.wait_reasons import RETRACTED
from telemetry.clock import now_ns


class Retractions:
    def __init__(self, args: ServerArgs, cache: CacheManager, policy: AdmissionPolicy) -> None:
        self.args, self.cache, self.policy = args, cache, policy
        self.total = 0  # cumulative: requests taken out of the batch
        self.tokens = 0  # the K/V positions they had

    def _step_need(self, running: list[Req], headroom: int) -> int:
        """Slots the running requests need this step: one per decode (plus `headroom` more), some prefill."""
        chunk = self.args.min_prefill_chunk if headroom else 1
        return sum(1 + headroom if r.prefill_done else min(chunk, r.prefill_len - r.num_computed) for r in running)

    def make_room(self, running: list[Req], waiting: WaitQueue) -> list[Req]:
        """Retract requests from `running` to the head of `waiting` until this step fits and every decoding
        request that stays has room for `headroom_steps` more tokens; never the last one (alone, it always
        fits).  Returns the requests retracted."""
        if self.policy.reserve or self.cache.available >= self._step_need(running, 0):
            return []
        order = [r for r in self.policy.victims(running) if not r.held]  # a held request keeps its KV
        victims: list[Req] = []
        while (
            order and len(running) > 1 and self.cache.available < self._step_need(running, self.policy.headroom_steps)
        ):
            req = order.pop(0)
            running.remove(req)
            victims.append(self._retract(req))
        for req in sorted(victims, key=lambda r: r.times.queued, reverse=True):
            waiting.appendleft(req)  # at the head, in arrival order
        self.policy.retracted(running)
        return victims

    def _retract(self, req: Req) -> Req:
        computed = req.num_computed
        kept = self.cache.retract(req)
        req.times.waiting_since = t = now_ns()
        req.times.retractions.append(Retraction(t, computed, kept, len(req.output_ids)))
        req.times.wait.set(RETRACTED, t, t)
        req.retracted_computed = computed
        req.prefill_len = req.total_len  # it resumes by computing its prompt and output, then samples
        req.status = ReqStatus.WAITING
        self.total += 1
        self.tokens += computed
        return req
