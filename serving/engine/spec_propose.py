"""Where speculative drafts come from: the `Proposer` interface, and prompt lookup (`NgramProposer`).

A proposer guesses the next tokens of a running request; the engine verifies the guess in its next forward
(`serving.engine.speculation`).  Prompt lookup needs no second model: outputs that copy their input (code
edits, JSON transforms, quotes, summaries) repeat runs of the prompt, so the tokens that followed the latest
earlier occurrence of the request's last n tokens are a cheap, often right, guess.

The interface carries what a draft model would also need: `verified` tells it how many of its tokens the
target kept (its own K/V past them is stale), `forget` that the request is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from serving.engine.request import Req


class Proposer(Protocol):
    method: str  # the `method` label of the speculation metrics

    def propose(self, req: Req, k: int) -> list[int]:
        """At most `k` tokens `req` is guessed to generate next (none: no guess this step)."""
        ...

    def propose_all(self, asks: list[tuple[Req, int]]) -> list[list[int]]:
        """`propose` for each (request, k) of a step at once (a draft model runs them as one batch); one by one
        unless the proposer does better."""
        return [self.propose(req, k) for req, k in asks]

    def verified(self, req: Req, proposed: int, accepted: int) -> None:
        """The target kept `accepted` of the `proposed` tokens (a draft model rolls its K/V back to them)."""
        ...

    def forget(self, req: Req) -> None:
        """`req` ended: whatever the proposer kept for it goes."""
        ...


INDEX_PER_STEP = 2048  # positions a lookup indexes at most: a long prompt is indexed over its first steps


@dataclass
class NgramIndex:
    """One request's n-grams (each length in [n_min, n_max]) → the position after their latest occurrence,
    built incrementally: positions [0, upto) have had the n-grams ending there indexed."""

    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0


class NgramProposer(Proposer):
    """Prompt lookup: the longest suffix of length n_max down to n_min that occurred before in the request's
    prompt + output proposes the (up to k) tokens that followed its latest earlier occurrence.  Each lookup
    indexes at most `INDEX_PER_STEP` new positions, oldest first, so a long prompt costs no step more than a
    few milliseconds; until it is indexed whole, only its indexed part is searched."""

    method = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[str, NgramIndex] = {}

    def propose(self, req: Req, k: int) -> list[int]:
        seq = req.seq
        idx = self.index.setdefault(req.rid, NgramIndex())
        last = min(len(seq) - 1, idx.upto + INDEX_PER_STEP)  # the suffix's n-grams: looked up, indexed next time
        for end in range(idx.upto, last):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                idx.after[tuple(seq[end + 1 - n : end + 1])] = end + 1
        idx.upto = max(idx.upto, last)
        for n in range(min(self.n_max, len(seq)), self.n_min - 1, -1):
            at = idx.after.get(tuple(seq[len(seq) - n :]))
            if at is not None:
                return seq[at : at + k]
        return []

    def verified(self, req: Req, proposed: int, accepted: int) -> None:
        """Nothing to roll back: the index reads the request's tokens as they are."""

    def forget(self, req: Req) -> None:
        self.index.pop(req.rid, None)
