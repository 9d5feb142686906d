"""The acceptance rule of speculative decoding: which of a draft's tokens the target model keeps.

A verified request fed [its last token] + k draft tokens and has k + 1 rows of logits: row i is the
target's distribution for the token after the draft's first i tokens.  Each row is transformed as the
sampler would transform it had those i tokens been sampled already (`DraftRow`: logit bias, penalties
over prompt + output + the draft so far, the min_tokens mask, temperature, top-k/top-p/min-p), so:

- greedy: draft tokens are kept while they are the row's argmax, then the first row whose argmax differs
  (or, every draft token kept, the last row's) gives the target's own token: the tokens greedy decoding
  without speculation gives;
- sampled: draft token x at row i is kept with probability p_i(x) (a prompt-lookup draft is deterministic:
  its own probability of x is 1); at the first refusal the token is drawn from p_i with x removed and
  renormalised, and with every draft token kept, from the last row.  Each emitted token then has exactly
  the target's distribution (Leviathan et al. 2023, Chen et al. 2023), drawn from the request's own
  generator (so a seeded request is reproducible, though not the same tokens as without speculation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol.sampling_params import SamplingParams
from serving.engine.sampling import adjust, probabilities

if TYPE_CHECKING:
    from serving.engine.request import Req


@dataclass
class DraftRow:
    """A request as the sampler sees it at one verified row: its output so far followed by the draft tokens
    before that row (`serving.engine.sampling.SamplingRow`)."""

    params: SamplingParams
    generator: torch.Generator
    input_ids: list[int]
    output_ids: list[int]


def draft_rows(req: Req, draft: list[int]) -> list[DraftRow]:
    return [
        DraftRow(req.params, req.generator, req.input_ids, req.output_ids + draft[:i]) for i in range(len(draft) + 1)
    ]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token of a (not necessarily normalised) float64 distribution [V], from the request's generator."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1]).clamp_(max=len(cdf) - 1))


def accept(logits: torch.Tensor, req: Req, draft: list[int], eos: frozenset[int]) -> list[int]:
    """The tokens `req` emits from its verified rows `logits` [len(draft) + 1, V]: the draft tokens kept, then
    one of the target's own."""
    rows = draft_rows(req, draft)
    adjusted = adjust(logits, rows, eos)
    if req.params.is_greedy:
        best = adjusted.argmax(-1).tolist()
        kept = next((i for i, d in enumerate(draft) if best[i] != d), len(draft))
        return draft[:kept] + [best[kept]]
    probs = probabilities(adjusted, rows)
    for i, d in enumerate(draft):
        if float(torch.rand(1, generator=req.generator, dtype=torch.float64)) >= float(probs[i, d]):
            rest = probs[i].clone()
            rest[d] = 0.0
            return draft[:i] + [_draw(rest, req.generator)]
    return draft + [_draw(probs[len(draft)], req.generator)]
