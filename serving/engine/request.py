"""A request inside the engine: its tokens, its KV bookkeeping and its timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from protocol.io_struct import Logprobs, SpecCounts
from protocol.reasons import FinishReason
from protocol.sampling_params import SamplingParams
from serving.engine.wait_reasons import WaitLedger
from telemetry.clock import now_ns

if TYPE_CHECKING:
    from serving.engine.embedding import PoolState
    from serving.engine.grammar import GrammarState
    from serving.engine.prefix_misses import PrefixMiss
    from serving.engine.radix_cache import TreeNode


def _new_times() -> ReqTimes:
    t = now_ns()
    return ReqTimes(queued=t, waiting_since=t)


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Retraction:
    """One time the request left the batch so that others could decode."""

    at: int  # monotonic ns
    computed: int  # positions whose K/V it had: the work it put at risk
    cached: int  # of those, left in the prefix cache (pinned) for its resumption; 0 without the cache
    output_tokens: int  # tokens it had generated (they stay: it resumes after them)
    reason: str = "kv_exhausted"  # a decode step would not have found a KV slot for every running request


@dataclass
class ReqTimes:
    """Monotonic-ns stamps (telemetry.clock.now_ns), turned into metrics and spans by telemetry.

    A request waits once (queued → scheduled) and once more after each retraction:
    `waits` holds every finished interval, `waiting_since` the open one.
    """

    queued: int = 0  # first entered the waiting queue
    scheduled: int | None = None  # first admitted into a batch
    waiting_since: int | None = None  # in the queue since (None while it runs)
    waits: list[tuple[int, int]] = field(default_factory=list)  # (entered, admitted) per waiting interval
    retractions: list[Retraction] = field(default_factory=list)
    first_token: int | None = None
    finished: int | None = None
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, tokens)
    token_times: list[int] = field(default_factory=list)  # one stamp per output token
    wait: WaitLedger = field(default_factory=WaitLedger)  # time per wait reason (serving.engine.wait_reasons)
    gaps: list = field(default_factory=list)  # long inter-token gaps (serving.engine.decode_gaps.DecodeGap)

    def waited_ns(self, now: int | None = None) -> int:
        """Time in the queue over every waiting interval (the open one up to `now`)."""
        open_ns = (now if now is not None else now_ns()) - self.waiting_since if self.waiting_since else 0
        return sum(b - a for a, b in self.waits) + max(0, open_ns)


MAX_SPEC_RUNS = 96  # verify steps kept per request for its span (its counts cover every step)


@dataclass
class SpecState:
    """One speculated request's draft length, this step's draft and its counts (`serving.engine.speculation`)."""

    k: int  # the longest draft it is proposed now
    draft: list[int] = field(default_factory=list)  # this step's (empty: it decodes one token)
    counts: SpecCounts = field(default_factory=SpecCounts)
    alpha: float = 0.0  # its estimate of the chance a draft token is kept (serving.engine.speculation)
    pauses: int = 0  # times it was paused
    paused: int = 0  # decode steps left before it is proposed again
    # its first MAX_SPEC_RUNS verify steps, (index of the step's first output token, proposed, accepted): the
    # `speculative_verify` events of its decode span, the inspector's accepted runs
    runs: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    row: int = -1  # row in the KV pool's req_to_token table
    num_computed: int = 0  # positions whose K/V are in the pool
    cached_tokens: int = 0  # prompt positions reused from the prefix cache at admission
    prefix_miss: PrefixMiss | None = None  # why the cache matched no more at admission (None: a hit, or no cache)
    tree_len: int = 0  # positions [0, tree_len) of its row are prefix-cache slots it locks
    tree_node: TreeNode | None = None  # the RadixCache node it locks (None: not admitted, or no prefix cache)
    max_new_tokens: int = 0  # params.max_new_tokens clamped to the context window
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    stop_ids: frozenset[int] = frozenset()  # params.stop_token_ids, for an O(1) check per token
    error: str | None = None  # why the engine failed it (finish_reason ERROR)
    prefill_len: int = 0  # positions computed before it decodes: the prompt, or on resumption prompt + output
    priority: int = 0  # its tenant's: higher is admitted first and retracted last (serving.engine.wait_queue)
    namespace: str = ""  # the prefix-cache namespace it reads and fills ("" the shared one)
    pinned: TreeNode | None = None  # retracted: the prefix-cache node its computed positions end at
    retracted_computed: int = 0  # positions it had at its latest retraction (recomputation is measured against it)
    pooling: PoolState | None = None  # an embedding request (prefill only): its pooled hidden state so far
    embedding: torch.Tensor | None = None  # its result, once its prompt has run (float32 [hidden])
    times: ReqTimes = field(default_factory=lambda: _new_times())
    hold: bool = False  # a test seam holds it before its last token (serving.engine.seams)
    prompt_logprobs: Logprobs | None = None  # prompt_logprobs asked: entries of prompt tokens 1.. scored so far
    prompt_cache_held: int = 0  # prompt positions the prefix cache held at admission, computed again to score them
    grammar: GrammarState | None = None  # structured output asked: its grammar (serving.engine.grammar)
    spec: SpecState | None = None  # speculated (serving.engine.speculation): its draft length, draft and counts

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    def __post_init__(self) -> None:
        self.prefill_len = self.prefill_len or len(self.input_ids)

    @property
    def score_from(self) -> int | None:
        """The first prompt position whose logits are still to be scored (it predicts the next prompt token);
        None when prompt logprobs were not asked for or are complete.  The prefix cache may give it no more
        than this many positions (`CacheManager.match`)."""
        lp = self.prompt_logprobs
        if lp is None or len(lp.token_logprobs) >= self.prompt_len - 1:
            return None
        return len(lp.token_logprobs)

    @property
    def grammar_pending(self) -> bool:
        """Its grammar is still compiling: it cannot be admitted yet (wait reason `grammar`)."""
        return self.grammar is not None and self.grammar.pending

    @property
    def held(self) -> bool:
        """Held by the test seam: running, its prompt done, one token short of its limit, not released."""
        return self.hold and self.prefill_done and len(self.output_ids) >= max(1, self.max_new_tokens - 1)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_len

    @property
    def seq(self) -> list[int]:
        """Every token it has: the prompt, then its output."""
        return self.input_ids + self.output_ids if self.output_ids else self.input_ids

    @property
    def num_retractions(self) -> int:
        return len(self.times.retractions)

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)
