"""Speculative decoding in the engine (`--speculative ngram` or `draft`): which requests are speculated, how long
their drafts are, and what a verify step leaves behind.

Each step, after admission (`SchedulerCore._schedule`), every decoding request that speculates gets a draft
from the proposer (prompt lookup, `serving.engine.spec_propose`, or a draft model, `serving.engine.spec_draft`),
within what the step has left: KV slots available after
its decodes and prefill chunks, and --max-step-tokens.  The forward feeds such a request [its last token] +
the draft as one extend segment with logits for every row (`serving.engine.forward_pass`); the acceptance
rule (`serving.engine.spec_accept`) says which tokens it emits.  `settle` then frees the K/V slots of the
rejected draft positions and counts the accepted ones computed, so the pool and the prefix cache only ever
hold positions of tokens the request has.  Its tokens go out through the engine's one append path, one
by one, so EOS, stop ids, max_new_tokens and min_tokens end it exactly where they would without speculation
(the rest of the run is dropped, and `CacheManager.release` frees its K/V).

Who is speculated: generation requests with `SamplingParams.speculative` (the default) and none of a
structured output (its grammar would have to be advanced along the draft), logprobs or the tests' hold
seam.  Penalties, logit bias and min_tokens are applied per verified row as if the draft's earlier tokens
had been sampled.

Draft length adapts per request (`best_k`): every verify updates its estimate α of the chance that a draft
token is kept (an exponential average, from `ALPHA_PRIOR`), and its next draft is the length k ≤
--speculative-num-tokens with the most expected tokens per step, (1 − α^(k+1)) / (1 − α), for what the step
costs, 1 + f + c · k.  f is what a one-stream verify step costs beyond a plain decode step before its rows
(`VERIFY_STEP_COST` with float weights; none beside other decoding requests, or with quantized weights, whose
row cost includes it); c is a verified row's cost: at one stream `DRAFT_ROW_COST` for float weights, where
the rows ride on the decode's own pass over them, `QUANT_ROW_COST` for quantized ones, and `WIDE_ROW_COST`
beside other decoding requests, whose tokens the step's time also buys (`batch_row_cost`; a draft that does
not pay there is not proposed that step).  Where even one draft token does not pay at one stream (α below
f + c), proposals pause for `PAUSE_STEPS` decode steps (doubling each time it pauses again, at most
`MAX_PAUSE_STEPS`), then a one-token probe (α `ALPHA_PROBE` above f + c) tries again: text that does not
copy pays a few verified rows per pause.
"""

from __future__ import annotations

import torch

from protocol.io_struct import SPECULATIVE_METHODS, MethodCount, MethodHistogram
from serving.args import ServerArgs
from serving.engine.kv_pool import KVPool
from serving.engine.loader import LoadedModel
from serving.engine.request import MAX_SPEC_RUNS, Req, SpecState
from serving.engine.spec_accept import accept
from serving.engine.spec_propose import NgramProposer, Proposer
from telemetry.stats import PhaseTimes

ALPHA_PRIOR = 0.6  # a new request's estimate that a draft token is kept
# its estimate after a pause, above what a row costs at one stream: a one-token draft, and misses pause it again
ALPHA_PROBE = 0.15
ALPHA_WEIGHT = 0.3  # how much one verify moves the estimate
# What one verified row costs beside a one-stream decode step's own, measured with bench.spec_row_cost
# (SmolLM2-135M float32, one thread): a decode step reads every weight once, and up to ~6 rows share that read
# (k = 1..5 draft rows added 0.2-3 % each); past that width each row costs ~0.1 of a decode step
DRAFT_ROW_COST = 0.05
# what a verify step costs beyond a plain one-stream decode step before its rows, with float weights: the plain
# step is one native call over every layer, a verify step runs the layers one by one with extend attention.
# bench.spec_row_cost: ~0 on one thread (k = 1: 0.99x), ~0.09 on two (k = 1: 1.135x, 2-core Zen 4), where
# free text's rare one-token guesses (7 % kept) then cost 6 % of its speed; the quantized rows' cost includes it
VERIFY_STEP_COST = 0.1
# the same with quantized weights (SmolLM2-135M Q4_1 GGUF on the int8 kernel, one thread): a decode step is
# ~4x shorter and each draft row adds 0.09-0.23 of it
QUANT_ROW_COST = 0.2
# batch_row_cost's row cost beside other decoding requests: with it a row at 8 streams costs ~0.7 of a token,
# as measured there (12 decoding requests' step against 8's: ~2.6 ms a row, where 8 give a token per ~3.8 ms)
WIDE_ROW_COST = 0.22
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 128
ACCEPTANCE_BOUNDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def best_k(alpha: float, most: int, cost: float = DRAFT_ROW_COST, fixed: float = 0.0) -> int:
    """The draft length in [1, most] with the most expected tokens per step for its cost, 1 + fixed + cost · k;
    0 when no draft pays (a step of one decode row gives one token for a cost of 1)."""
    value = {k: sum(alpha**i for i in range(k + 1)) / (1 + fixed + cost * k) for k in range(1, most + 1)}
    k = max(value, key=value.__getitem__)
    return k if value[k] > 1.0 else 0


def batch_row_cost(decoding: int, one: float = DRAFT_ROW_COST) -> float:
    """What a verified row costs for a request decoding beside `decoding - 1` others, in that request's tokens:
    the row's cost against what the step's time buys now, `decoding` tokens for 1 + WIDE_ROW_COST · (decoding
    − 1).  One stream: `one`, the row cost of the weights' kernel; the larger the batch, the more a row's time
    is worth in tokens, so only drafts that are kept more often pay (at 8 streams, α above ~0.7)."""
    if decoding <= 1:
        return one
    return WIDE_ROW_COST * decoding / (1 + WIDE_ROW_COST * (decoding - 1))


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        max_tokens: int,
        max_step_tokens: int,
        row_cost: float = DRAFT_ROW_COST,
        step_cost: float = 0.0,
    ) -> None:
        self.proposer, self.max_tokens, self.max_step_tokens = proposer, max_tokens, max_step_tokens
        self.row_cost = row_cost  # a verified row's cost at one stream, for these weights' kernel
        self.step_cost = step_cost  # a one-stream verify step's cost beyond a decode step's, before its rows
        self.method = proposer.method
        self.proposed = self.accepted = 0  # cumulative, every request's
        self.acceptance = PhaseTimes((self.method,), ACCEPTANCE_BOUNDS, MethodHistogram)
        self.step_tokens = PhaseTimes(
            (self.method,), tuple(float(i) for i in range(1, max_tokens + 2)), MethodHistogram
        )

    @classmethod
    def from_args(cls, args: ServerArgs, target: LoadedModel, quantization: str = "none") -> Speculator | None:
        """The flags' speculator (None: off); a draft model is loaded and checked against `target` here.
        `quantization`: the target's weights as the engine runs them (`Precision.quantization`)."""
        if args.speculative == "off":
            return None
        if args.speculative == "draft":
            from serving.engine.spec_draft import DraftProposer  # imports the model runner: only when asked

            proposer: Proposer = DraftProposer(target, args)
        else:
            # a one-token key's guesses pay where rows are cheap: float weights (docs/engine.md)
            n_min = args.speculative_ngram_min or (1 if quantization == "none" else 2)
            proposer = NgramProposer(min(n_min, args.speculative_ngram_max), args.speculative_ngram_max)
        float_weights = quantization == "none"
        row_cost, step_cost = (DRAFT_ROW_COST, VERIFY_STEP_COST) if float_weights else (QUANT_ROW_COST, 0.0)
        return cls(proposer, args.speculative_num_tokens, args.max_step_tokens, row_cost, step_cost)

    # -- per request ------------------------------------------------------------------
    def attach(self, req: Req) -> None:
        """A new request: speculated unless it opted out or needs what a verify step does not give."""
        p = req.params
        if req.pooling is None and p.speculative and p.structured is None and p.logprobs is None and not req.hold:
            req.spec = SpecState(best_k(ALPHA_PRIOR, self.max_tokens, self.row_cost, self.step_cost), alpha=ALPHA_PRIOR)

    def propose(self, decoding: list[Req], room: int, step_tokens: int) -> int:
        """Drafts for this step's decoding requests, within `room` KV slots and the step's token budget (it
        feeds `step_tokens` without them); returns the draft tokens proposed."""
        asks, total, budget = [], 0, min(room, self.max_step_tokens - step_tokens)
        cost = batch_row_cost(len(decoding), self.row_cost)
        fixed = self.step_cost if len(decoding) == 1 else 0.0  # beside others the rows' cost says it all
        for req in decoding:
            st = req.spec
            if st is None:
                continue
            st.draft = []
            if st.paused:
                st.paused -= 1
                continue
            k = min(best_k(st.alpha, st.k, cost, fixed), req.max_new_tokens - len(req.output_ids) - 1, budget - total)
            if k >= 1:
                asks.append((req, k))
                total += k  # at most k: the budget is never passed, whatever the drafts' lengths
        for (req, _), draft in zip(asks, self.proposer.propose_all(asks)):
            req.spec.draft = draft
        return sum(len(req.spec.draft) for req, _ in asks)

    def verify(self, logits: torch.Tensor, req: Req, eos: frozenset[int]) -> list[int]:
        """The tokens `req` emits from its verified rows (`serving.engine.spec_accept.accept`)."""
        return accept(logits, req, req.spec.draft, eos)

    def settle(self, req: Req, tokens: list[int], pool: KVPool) -> None:
        """After a successful verify step that counted its last token computed: the accepted draft positions
        count too, the rejected ones' slots are freed, the counts and the next draft length follow."""
        st = req.spec
        proposed, kept = len(st.draft), len(tokens) - 1
        start = req.num_computed + kept
        pool.free(pool.req_to_token[req.row, start : req.num_computed + proposed].clone())
        req.num_computed = start
        self.proposer.verified(req, proposed, kept)
        st.counts.proposed += proposed
        st.counts.accepted += kept
        if len(st.runs) < MAX_SPEC_RUNS:  # its tokens are appended after the step: the run starts at this index
            st.runs.append((len(req.output_ids), proposed, kept))
        self.proposed += proposed
        self.accepted += kept
        self.step_tokens.observe(self.method, len(tokens))
        st.draft = []
        trials = kept + (kept < proposed)  # the draft tokens judged: those kept, and the first refused
        st.alpha += ALPHA_WEIGHT * (kept / trials - st.alpha)
        st.k = best_k(st.alpha, self.max_tokens, self.row_cost, self.step_cost)
        if not st.k:  # drafts do not pay for this request now: try again later, with a one-token probe
            st.paused = min(MAX_PAUSE_STEPS, PAUSE_STEPS << st.pauses)
            st.pauses, st.alpha = st.pauses + 1, self.row_cost + self.step_cost + ALPHA_PROBE
            st.k = 1

    def finished(self, req: Req) -> None:
        """`req` ended: its acceptance rate observed (if it was ever verified), the proposer's state dropped."""
        if req.spec.counts.proposed:
            self.acceptance.observe(self.method, req.spec.counts.accepted / req.spec.counts.proposed)
        self.proposer.forget(req)

    @staticmethod
    def off_stats() -> dict[str, object]:
        """The speculation's part of `SchedulerStats` with --speculative off: every counter at 0, no histogram."""
        zeros = [MethodCount(m, 0) for m in SPECULATIVE_METHODS]
        return {
            "speculative_proposed": zeros,
            "speculative_accepted": list(zeros),
            "speculative_acceptance": [],
            "speculative_step_tokens": [],
        }

    def stats(self) -> dict[str, object]:
        """The speculation's part of `SchedulerStats`, by field name."""
        return {
            "speculative_proposed": [MethodCount(self.method, self.proposed)],
            "speculative_accepted": [MethodCount(self.method, self.accepted)],
            "speculative_acceptance": self.acceptance.snapshot(),
            "speculative_step_tokens": self.step_tokens.snapshot(),
        }
