"""Admission and retraction policy: how much KV a request is expected to need, and who leaves first.

A request's *need* is the KV slots it is expected to allocate from now on:

    need = (tokens it has but not yet computed) + ratio × min(output tokens it may still generate, clip)

The head of the queue is admitted when its need (less the prefix the cache holds, plus the
cached slots its lock takes from the evictable pool) and the running requests' needs fit
in the slots available (free or evictable).  Admission stays strict FCFS.

- `reserve`: ratio 1, no clip — the worst case, as a reservation: a running request
  always finds its next slot, nothing is ever retracted; concurrency is what
  prompt + max_new_tokens allows (the whole context window for clients that set no max).
- `estimate` (SGLang's `new_token_ratio`): the ratio starts at `init_ratio`, decays by
  `decay` after every step that decodes, down to `min_ratio`, and after a retraction
  jumps to max(init_ratio, what the running requests already used of their clipped
  output budget, plus `headroom_steps` tokens each), at most 1.  A step that would not
  find a slot for every decoding request retracts requests (`victims`) first.

Victims: lowest `priority` first (every request has 0 today: tenants will set it), then
fewest output tokens (the least decode work lost), then the longest prompt (the most KV
freed), then the latest arrival.  The same order as SGLang's `retract_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from serving.args import ServerArgs
from serving.engine.request import Req

ESTIMATE, RESERVE = "estimate", "reserve"


@dataclass
class AdmissionPolicy:
    mode: str = ESTIMATE
    init_ratio: float = 0.7
    min_ratio: float = 0.098  # 0.14 × init_ratio
    decay: float = (0.7 - 0.098) / 600
    clip: int = 2048  # the most output tokens one request counts for in the estimate
    headroom_steps: int = 20  # a retraction leaves room for this many decode steps of every remaining request
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = 1.0 if self.reserve else self.init_ratio

    @classmethod
    def from_args(cls, args: ServerArgs) -> AdmissionPolicy:
        init = args.init_new_token_ratio
        low = init * args.min_new_token_ratio_factor
        return cls(
            mode=args.admission,
            init_ratio=init,
            min_ratio=low,
            decay=(init - low) / args.new_token_ratio_decay_steps,
            clip=args.new_token_clip,
        )

    @property
    def reserve(self) -> bool:
        return self.mode == RESERVE

    def need(self, req: Req) -> float:
        """KV slots `req` is expected to allocate from now on (exactly its worst case under `reserve`)."""
        future = req.max_new_tokens - len(req.output_ids)
        if self.reserve:
            return req.total_len - req.num_computed + future
        return req.total_len - req.num_computed + self.ratio * min(future, self.clip)

    def committed(self, running: Iterable[Req]) -> float:
        return sum(self.need(r) for r in running)

    def stepped(self, decoded: bool) -> None:
        """A step without retraction ran; its decodes are evidence that the estimate holds."""
        if decoded and not self.reserve:
            self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def retracted(self, running: Iterable[Req]) -> None:
        """Requests had to be retracted: the estimate was too low for the ones still running."""
        used = budget = 0
        for r in running:
            used += min(len(r.output_ids), self.clip) + self.headroom_steps
            budget += min(r.max_new_tokens, self.clip)
        observed = used / budget if budget else 1.0
        self.ratio = min(1.0, max(self.init_ratio, observed))

    def victims(self, running: Iterable[Req]) -> list[Req]:
        """Running requests in the order they would be retracted."""
        return sorted(running, key=lambda r: (r.priority, len(r.output_ids), -r.prompt_len, -r.times.queued))
