"""Log-probabilities of sampled tokens (`SamplingParams.logprobs`) and of prompt tokens (`prompt_logprobs`).

Sampled tokens, per `--logprobs-mode`:
- `processed` (the default): the distribution the sampler draws from before its cuts, as vLLM's
  processed mode documents: log_softmax over the whole vocabulary of the logits after
  logit_bias, penalties and the min_tokens mask (`serving.engine.sampling.adjust`), divided by
  the temperature (not for greedy rows, which take the argmax); top-k, top-p and min-p are not
  applied, so a token they would cut still has its probability.
- `raw`: log_softmax of the model's logits, untouched.

Prompt tokens are scored from the model's logits in either mode: the sampling adjustments say how
the next output token is drawn (penalties and min_tokens depend on the output so far), not how
the prompt was written.

Only the rows that ask pay: one batched op over those rows (the logsumexp, a gather of the chosen
tokens, one top-k at the largest N asked), never a [rows, vocab] log_softmax.  Prompt rows go
through the lm_head in blocks of `BLOCK_ROWS` (`CausalLM.head`), so a 512-token chunk never holds
more than a block's logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from protocol.io_struct import Logprobs
from serving.engine.sampling import SamplingRow

if TYPE_CHECKING:
    from serving.engine.request import Req

MODES = ("processed", "raw")
BLOCK_ROWS = 64  # prompt rows per lm_head call: 64 x 49152 float32 logits = 12.6 MB


def _score(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log-prob of each row's target [R], top-k log-probs [R, k], their ids [R, k]) of logits [R, V]."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    own = (logits.gather(1, targets[:, None]) - lse).squeeze(1)
    if not k:
        return own, None, None
    top, ids = torch.topk(logits, k, dim=-1)
    return own, top - lse, ids


def _entries(
    own: torch.Tensor, top: torch.Tensor | None, ids: torch.Tensor | None, ks: Sequence[int]
) -> list[tuple[float, list[int], list[float]]]:
    """Per row: its own log-prob and its first `ks[i]` alternatives, as Python lists (one conversion each)."""
    own_l = own.tolist()
    if top is None or ids is None:
        return [(o, [], []) for o in own_l]
    top_l, ids_l = top.tolist(), ids.tolist()
    return [(o, i[:k], t[:k]) for o, i, t, k in zip(own_l, ids_l, top_l, ks)]


def as_logprobs(entries: Sequence[tuple[float, list[int], list[float]]], k: int) -> Logprobs:
    """Scored entries as the wire's `Logprobs` (alternatives only when `k` > 0)."""
    return Logprobs(
        token_logprobs=[e[0] for e in entries],
        top_ids=[e[1] for e in entries] if k else [],
        top_logprobs=[e[2] for e in entries] if k else [],
    )


def extend(into: Logprobs, more: Logprobs) -> None:
    """Append `more`'s entries to `into` (a request's prompt logprobs, chunk by chunk)."""
    into.token_logprobs.extend(more.token_logprobs)
    into.top_ids.extend(more.top_ids)
    into.top_logprobs.extend(more.top_logprobs)


def output_logprobs(
    raw: torch.Tensor, adjusted: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor, mode: str
) -> list[Logprobs | None] | None:
    """Per sampled row, the log-prob of its token and its top `params.logprobs` alternatives (None for rows
    that did not ask; None for all when no row asks); `raw` the model's logits, `adjusted` the sampler's
    (`sampling.adjust`)."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asking:
        return None
    out: list[Logprobs | None] = [None] * len(rows)
    src = raw if mode == "raw" else adjusted
    idx = None if len(asking) == len(rows) else torch.tensor(asking, dtype=torch.int64)  # None: every row, no copy
    logits, chosen = (src, tokens) if idx is None else (src[idx], tokens[idx])
    if mode != "raw":
        temps = [1.0 if rows[i].params.is_greedy else rows[i].params.temperature for i in asking]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=logits.dtype)[:, None]
    ks = [rows[i].params.logprobs or 0 for i in asking]
    entries = _entries(*_score(logits, chosen, max(ks)), ks)
    for i, k, e in zip(asking, ks, entries):
        out[i] = as_logprobs([e], k)
    return out


def prompt_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    ks: Sequence[int],
    block: int = BLOCK_ROWS,
) -> list[tuple[float, list[int], list[float]]]:
    """Per scored row of `hidden` (final-normed, `ModelRunner.scored`): the log-prob of `targets[i]`, the
    prompt token it predicts, and its top `ks[i]` alternatives; the lm_head runs `block` rows at a time."""
    out: list[tuple[float, list[int], list[float]]] = []
    target_t = torch.tensor(targets, dtype=torch.int64)
    for b in range(0, len(targets), block):
        kb = ks[b : b + block]
        logits = head(hidden[b : b + block])
        out += _entries(*_score(logits, target_t[b : b + block], max(kb)), kb)
    return out


@dataclass
class PromptScore:
    """One prefill chunk's rows scored for prompt logprobs: rows [a, b) of the chunk fed from `start`."""

    req: Req
    start: int
    rows: tuple[int, int]


def score_window(req: Req, start: int, n: int) -> tuple[int, int] | None:
    """Rows [a, b) of a chunk feeding positions [start, start + n) whose prompt logprobs are still missing:
    from the first unscored position to the last prompt position but one (the last predicts the first output
    token).  None when there are none (not asked, all scored, or a resumed request's output positions)."""
    first = req.score_from
    if first is None:
        return None
    a, b = max(first, start) - start, min(start + n, req.prompt_len - 1) - start
    return (a, b) if b > a else None


def score_prompts(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, scoring: Sequence[PromptScore]
) -> list[Logprobs]:
    """Per chunk of `scoring` (in the order of their rows in `hidden`), the entries of its scored rows: row i
    of a chunk from `start` predicts prompt token start + i + 1."""
    targets: list[int] = []
    ks: list[int] = []
    for sc in scoring:
        a, b = sc.rows
        targets += sc.req.input_ids[sc.start + a + 1 : sc.start + b + 1]
        ks += [sc.req.params.prompt_logprobs or 0] * (b - a)
    entries = prompt_logprobs(head, hidden, targets, ks)
    out, i = [], 0
    for sc in scoring:
        n = sc.rows[1] - sc.rows[0]
        out.append(as_logprobs(entries[i : i + n], sc.req.params.prompt_logprobs or 0))
        i += n
    return out
