"""A request inside the engine: its tokens, its KV bookkeeping and its timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from protocol.sampling_params import SamplingParams
from telemetry.clock import now_ns
from telemetry.outcomes import FinishReason  # one table of how requests end, the engine's finish reasons included

if TYPE_CHECKING:
    from serving.engine.radix_cache import TreeNode


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ReqTimes:
    """Monotonic-ns stamps (telemetry.clock.now_ns), turned into metrics and spans by telemetry."""

    queued: int = 0  # entered the waiting queue
    scheduled: int | None = None  # first admitted into a batch
    first_token: int | None = None
    finished: int | None = None
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, tokens)
    token_times: list[int] = field(default_factory=list)  # one stamp per output token


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
    reserved: int = 0  # KV slots promised for its own positions at admission, less those it handed the tree
    cached_tokens: int = 0  # prompt positions reused from the prefix cache at admission
    tree_len: int = 0  # positions [0, tree_len) of its row are prefix-cache slots it locks
    tree_node: TreeNode | None = None  # the RadixCache node it locks (None: not admitted, or no prefix cache)
    max_new_tokens: int = 0  # params.max_new_tokens clamped to the context window
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    stop_ids: frozenset[int] = frozenset()  # params.stop_token_ids, for an O(1) check per token
    error: str | None = None  # why the engine failed it (finish_reason ERROR)
    times: ReqTimes = field(default_factory=lambda: ReqTimes(queued=now_ns()))

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prompt_len

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)
