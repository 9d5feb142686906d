"""One engine step's forward and sampling over a group of (request, tokens to feed), and the isolation of
the requests that make it fail.

`run` feeds decodes and prefill chunks side by side through the model (`ModelRunner.step`), samples a
token for every request whose prompt is complete (through its grammar's mask, if it has one), scores
prompt logprobs and pools embedding inputs.  A decoding request with a speculative draft is fed its last
token and the draft as decode rows of its own, one a position, after the plain decodes (each row attends to
the positions up to its own, its batch mates' K/V written first: the decode path, its native kernels and
its one-call layer stack, computes them as it computes a plain decode), and verified from their logits
(`serving.engine.speculation`): it may produce several tokens.  Positions (and their prompt logprobs)
count only on success; on failure nothing of it remains, so `isolate` can rerun halves of the group until
each failing request stands alone.  The phase times it measured (forward, sample, grammar, logprobs,
verify) are read into the step's record by `SchedulerCore.step`.

Fault injection (tests): with SIGHTLINE_FAULT_SEED=N in the environment, a run that includes a request
seeded N raises after its forward pass, as a torch error would.
"""

from __future__ import annotations

import os

import torch

from protocol.io_struct import Logprobs
from serving.args import ServerArgs
from serving.engine.batch import Work
from serving.engine.embedding import pool_rows
from serving.engine.grammar import Grammars
from serving.engine.logprobs import PromptScore, extend, output_logprobs, score_prompts, score_window
from serving.engine.model_runner import ModelRunner
from serving.engine.request import Req
from serving.engine.sampling import adjust, pick
from serving.engine.speculation import Speculator
from telemetry.clock import now_ns

FAULT_SEED_ENV = "SIGHTLINE_FAULT_SEED"
Produced = tuple[Req, int, Logprobs | None]  # a request, its sampled token (-1: pooled, no token), its logprobs


class ForwardPass:
    def __init__(
        self,
        runner: ModelRunner,
        grammar: Grammars,
        args: ServerArgs,
        eos_ids: frozenset[int],
        spec: Speculator | None = None,
    ) -> None:
        self.runner, self.grammar, self.args, self.eos_ids, self.spec = runner, grammar, args, eos_ids, spec
        fault = os.environ.get(FAULT_SEED_ENV)
        self.fault_seed = int(fault) if fault else None
        self.reset()

    def reset(self) -> None:
        """A new step: its phase times start at 0."""
        self.forward_ns = self.sample_ns = self.logprobs_ns = self.grammar_ns = self.verify_ns = 0

    def run_isolated(self, group: list[tuple[Req, int]]) -> tuple[list[Produced], list[tuple[Req, Exception]]]:
        """`run`, and on failure `isolate`: what the group produced, and the requests that failed alone."""
        try:
            return self.run(group), []
        except Exception as exc:  # noqa: BLE001 - find the requests responsible, keep the rest
            return self.isolate(group, exc)

    def run(self, group: list[tuple[Req, int]]) -> list[Produced]:
        """Forward + sample one group of (request, tokens to feed); returns (request, token, its logprobs) per
        sampled request."""
        decode_work, verify_work, extend_work, sampled_d, verified, sampled_e, scoring = [], [], [], [], [], [], []
        for req, n in group:
            if not req.prefill_done:
                continue
            if req.spec is not None and req.spec.draft:  # its last token and its draft, one decode row each
                ids, at = [req.output_ids[-1], *req.spec.draft], req.total_len - 1
                verify_work.append([Work(req.row, at + i, [t], True) for i, t in enumerate(ids)])
                verified.append(req)
            else:
                decode_work.append(Work(req.row, req.total_len - 1, [req.output_ids[-1]], True))
                sampled_d.append(req)
        num_verify = sum(len(w) for w in verify_work)  # their logits rows follow the decodes'
        pooled, embedded, hidden_rows, offset = [], [], [], len(decode_work) + num_verify
        for req, n in group:
            if not req.prefill_done:
                start = req.num_computed
                completes = start + n >= req.prefill_len
                score = score_window(req, start, n)
                extend_work.append(
                    Work(req.row, start, req.seq[start : start + n], completes and not req.pooling, score)
                )
                if score is not None:
                    scoring.append(PromptScore(req, start, score))
                if req.pooling is not None:  # an embedding request: its pooled rows, no logits
                    rows = pool_rows(req.pooling.mode, offset, start, n, completes)
                    hidden_rows.extend(rows)
                    pooled.append((req, start, len(rows)))
                    embedded += [req] if completes else []
                elif completes:
                    sampled_e.append(req)
                offset += n
        sampled = sampled_d + sampled_e  # the order of their logits rows, around the verified requests'
        t0 = now_ns()
        fed = decode_work + [w for rows in verify_work for w in rows]
        with self.runner.step(fed, extend_work, hidden_rows) as rows:
            t1 = now_ns()
            self.forward_ns += t1 - t0
            if self.fault_seed is not None and any(r.params.seed == self.fault_seed for r, _ in group):
                raise RuntimeError(f"fault injected by {FAULT_SEED_ENV}")
            nd = len(sampled_d)
            logits = torch.cat([rows[:nd], rows[nd + num_verify :]]) if num_verify else rows
            adjusted = adjust(logits, sampled, self.eos_ids)
            t_mask = t_masked = 0
            masked = None
            if self.grammar.live:
                t_mask = now_ns()
                raw = self.args.logprobs_mode == "raw"  # a masked row's raw logprobs need the model's logits kept
                adjusted, masked = self.grammar.mask(
                    logits,
                    adjusted,
                    sampled,
                    keep_raw=raw and any(r.grammar is not None and r.params.logprobs is not None for r in sampled),
                )
                t_masked = now_ns()
                self.grammar_ns += t_masked - t_mask
            picked = pick(adjusted, sampled, masked)
            tokens = picked.tolist()
            t2 = now_ns()
            self.sample_ns += t2 - t1 - (t_masked - t_mask)
            lps = output_logprobs(logits, adjusted, sampled, picked, self.args.logprobs_mode)  # None: none asked
            prompt_lps = score_prompts(self.runner.model.head, self.runner.scored, scoring) if scoring else []
            if lps is not None or scoring:
                self.logprobs_ns += now_ns() - t2
            runs = self._verify(rows, nd, verified, verify_work) if verified else []
        for req, n in group:
            req.num_computed += n
        for req, run in zip(verified, runs):
            self.spec.settle(req, run, self.runner.pool)
        for req in sampled + verified:
            if req.spec is not None:
                req.spec.counts.steps += 1
        for sc, lp in zip(scoring, prompt_lps):
            extend(sc.req.prompt_logprobs, lp)
        i = 0
        for req, start, k in pooled:
            if k:
                req.pooling.add(self.runner.hidden[i : i + k], start)
            i += k
        return (
            list(zip(sampled, tokens, lps or [None] * len(sampled)))
            + [(req, tok, None) for req, run in zip(verified, runs) for tok in run]
            + [(req, -1, None) for req in embedded]  # -1: pooled, no token
        )

    def _verify(self, rows: torch.Tensor, at: int, verified: list[Req], work: list[list[Work]]) -> list[list[int]]:
        """Each verified request's tokens from its logits rows (from row `at` on, in `work`'s order)."""
        t0 = now_ns()
        runs = []
        for req, w in zip(verified, work):
            n = len(w)
            runs.append(self.spec.verify(rows[at : at + n], req, self.eos_ids))
            at += n
        self.verify_ns += now_ns() - t0
        return runs

    def isolate(
        self, group: list[tuple[Req, int]], exc: Exception
    ) -> tuple[list[Produced], list[tuple[Req, Exception]]]:
        """`group` failed with `exc`: rerun its halves until every failing request stands alone."""
        if len(group) == 1:
            return [], [(group[0][0], exc)]
        produced: list[Produced] = []
        failed: list[tuple[Req, Exception]] = []
        mid = len(group) // 2
        for half in (group[:mid], group[mid:]):
            try:
                produced += self.run(half)
            except Exception as sub:  # noqa: BLE001
                p, f = self.isolate(half, sub)
                produced += p
                failed += f
        return produced, failed
