"""A time budget for the prefill a step carries beside its decodes, from what the steps so far have cost.

A step's duration is every decoding request's inter-token gap, and a prompt token costs the step far more
than a decode row where the decodes alone do not load the machine (a GEMM over a few rows is bound by
reading the weights; every prefill token adds its full share of compute).  A token cap alone
(--max-step-tokens) therefore lets a mixed step take many times a pure-decode step at a modest batch,
which is the inter-token tail.  So the prefill is sized against time:

- the cost model (`StepCost`): step seconds ≈ fixed + per_decode × decode tokens + per_prefill × prefill
  tokens, fitted by exponentially weighted least squares of the relative error over the steps run (EWMAs of
  the normal equations, half-life `HALF_LIFE` steps), so it follows the machine, the model, its precision and
  the context lengths; a step over `OUTLIER` × its prediction counts as that (preempted, not dearer);
- the anchor (`StepBudget.probe`): a step's decodes alone tell the fit what the prefill costs on top of; when
  none ran for about a half-life (a long admission burst), one step runs its decodes without prefill;
- the budget (`StepBudget.prefill_tokens`): --step-time-factor × the typical step, capped at --max-step-ms
  when set; the prefill tokens are what fits in it after this step's decodes.  The typical step is the
  predicted pure-decode step of the batch the queue is heading to (running and waiting requests, at most
  --max-running-requests): what a stream waits between two tokens once the prompts that wait have joined, the
  p50 a tail is measured against.  Early in a burst, while few requests decode, the steps carry more prefill
  than a budget of their own few decodes would allow, so the burst's time to first token does not grow with
  its size.
  `BatchBuilder.prefill_budget` keeps them within the token caps and at least --min-prefill-chunk,
  so prompts always progress and time to first token cannot collapse.

The fit keeps every term ≥ 0 and a prompt token at least `TOKEN_FLOOR` of a decode row (a mixed step's
decodes and prefill are collinear while the token cap sizes it: a plain fit could give a negative fixed cost,
or prompt tokens nearly free, and a budget from it far too large).  A decode row may cost more than a prompt
token, and usually does: besides the layers' linears that both go through, it carries a row of the lm_head
and attends over its whole context from the pool (SmolLM2 Q4_1 on one core, ~150 positions: ~2 ms a decode
row, ~1 ms a prompt token).  Held to at least a decode row, the fit priced both at ~1 ms and predicted a
16-stream decode step of 21 ms that took 31, so the budget, a multiple of it, was a third short.  Before it
has seen `MIN_STEPS` steps, the floor runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving.engine.events import StepStats

HALF_LIFE = 32.0  # steps after which a step's weight in the fit has halved
RIDGE = 1e-6  # relative damping of the normal equations: a term the steps never varied stays near 0
MIN_STEPS = 3  # steps seen before the fit is used
OUTLIER = 3.0  # a step longer than this × its prediction counts as this × (a preempted step, a GC pause)
PROBE_BELOW = 0.5  # a step runs its decodes alone when the pure-decode steps' EW count falls below this
TOKEN_FLOOR = 0.5  # a prompt token costs at least this share of a decode row


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a·x = b (Gaussian elimination, partial pivoting); None when singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def nonnegative_fit(xx: list[list[float]], xt: list[float]) -> tuple[float, ...] | None:
    """The least-squares coefficients ≥ 0 from the normal equations (xx, xt): every subset of the terms solved
    alone, the feasible one with the least squared error kept (3 terms: 7 small solves)."""
    k = len(xt)
    whole = _solve(xx, xt)
    if whole is not None and min(whole) >= 0:  # the usual case: the unconstrained fit is feasible
        return tuple(whole)
    best, best_err = None, math.inf
    for mask in range(1, 1 << k):
        idx = [i for i in range(k) if mask >> i & 1]
        sol = _solve([[xx[i][j] for j in idx] for i in idx], [xt[i] for i in idx])
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * k
        for i, v in zip(idx, sol):
            coef[i] = v
        # the squared error less Σ t² (the same for every candidate): cᵀ·xx·c − 2·cᵀ·xt
        err = sum(coef[i] * xx[i][j] * coef[j] for i in range(k) for j in range(k)) - 2 * sum(
            c * t for c, t in zip(coef, xt)
        )
        if err < best_err:
            best, best_err = tuple(coef), err
    return best


@dataclass
class StepCost:
    """Step seconds as fixed + per_decode × decode tokens + per_prefill × prefill tokens, learned online."""

    half_life: float = HALF_LIFE
    # the normal equations, each step's row x = (1, d + TOKEN_FLOOR·p, p) / seconds against 1: EW Σ x xᵀ and EW Σ x
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xt: list[float] = field(default_factory=lambda: [0.0] * 3)
    steps: int = 0
    decode_weight: float = 0.0  # EW count of pure-decode steps: the anchor of the pure-decode prediction
    _coef: tuple[float, ...] | None = None
    _stale: bool = False  # steps observed since `_coef` was fitted (the fit runs when a budget is asked for)

    @property
    def coef(self) -> tuple[float, ...] | None:
        """(fixed, per_decode, per_prefill) seconds; None before `MIN_STEPS` steps."""
        if self._stale:
            self._stale = False
            damped = [
                [v + (RIDGE * v + 1e-12 if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self.xx)
            ]
            fit = nonnegative_fit(damped, self.xt) if self.steps >= MIN_STEPS else None
            self._coef = None if fit is None else (fit[0], fit[1], TOKEN_FLOOR * fit[1] + fit[2])
        return self._coef

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """One step ran `decode_tokens` decode rows and `prefill_tokens` prompt tokens in `seconds`."""
        if decode_tokens + prefill_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        if (c := self._coef) is not None:  # a step another process preempted must not teach that tokens got dearer
            seconds = min(seconds, OUTLIER * max(c[0] + c[1] * decode_tokens + c[2] * prefill_tokens, 1e-6))
        keep = 0.5 ** (1.0 / self.half_life)
        # each step weighted by 1 / seconds²: relative errors, so a long prefill step does not drown the decodes
        # fitted as fixed + per_row × (d + TOKEN_FLOOR · p) + extra × p, every term ≥ 0: a prompt token costs at
        # least TOKEN_FLOOR of a decode row (both are a row through every linear layer)
        x = (1.0 / seconds, (decode_tokens + TOKEN_FLOOR * prefill_tokens) / seconds, prefill_tokens / seconds)
        for i in range(3):
            self.xt[i] = keep * self.xt[i] + x[i]
            for j in range(3):
                self.xx[i][j] = keep * self.xx[i][j] + x[i] * x[j]
        self.decode_weight = keep * self.decode_weight + (prefill_tokens == 0)
        self.steps += 1
        self._stale = True

    def predict(self, decode_tokens: int, prefill_tokens: int) -> float:
        """The fitted step seconds (0 before the fit)."""
        if self.coef is None:
            return 0.0
        return self.coef[0] + self.coef[1] * decode_tokens + self.coef[2] * prefill_tokens

    def decode_seconds(self, decode_tokens: int) -> float | None:
        """The predicted pure-decode step of `decode_tokens` rows; None until the fit says something sensible."""
        t = self.predict(decode_tokens, 0)
        return t if t > 0 else None

    @property
    def per_prefill(self) -> float | None:
        """Seconds one prompt token adds to a step; None until the fit finds it positive."""
        return self.coef[2] if self.coef is not None and self.coef[2] > 0 else None


@dataclass
class StepBudget:
    """The prefill tokens a step with decodes may carry (`prefill_tokens`), and the latest budget (telemetry)."""

    factor: float  # × the typical step (pure-decode, of the batch the queue heads to); 0: no time budget
    max_seconds: float  # absolute cap on the budget; 0: none
    cost: StepCost = field(default_factory=StepCost)
    last_seconds: float = 0.0  # the latest step's time budget (0: none applied)
    last_tokens: int = 0  # the latest step's prefill budget in tokens, caps and floor applied (BatchBuilder)

    @property
    def on(self) -> bool:
        return self.factor > 0 or self.max_seconds > 0

    def observe(self, st: StepStats) -> None:
        """A step ran: its decode tokens, prefill tokens and duration join the fit."""
        if self.on and st.batch_size:
            self.cost.observe(sum(st.tokens) - st.num_prefill_tokens, st.num_prefill_tokens, st.step_seconds)

    @property
    def probe(self) -> bool:
        """This step should run its decodes alone: no pure-decode step within about a half-life (a long admission
        burst runs none), so the fit's pure-decode prediction would rest on mixed steps only."""
        return self.on and self.cost.decode_weight < PROBE_BELOW

    def prefill_tokens(self, decode_tokens: int, heading: int = 0) -> int | None:
        """Prompt tokens that fit beside `decode_tokens` decodes in the time budget (0 or more), the typical step
        being the pure-decode step of `heading` rows when more (the batch the queue is heading to).  0 before the
        first `MIN_STEPS` steps (the floor runs, and its steps teach the fit); None when there is no time budget,
        or when the fit finds a pure-decode step or a prompt token free (the token caps alone)."""
        self.last_seconds = 0.0
        if not self.on:
            return None
        if self.cost.coef is None:
            return 0
        decode_s, per_prefill = self.cost.decode_seconds(decode_tokens), self.cost.per_prefill
        typical = self.cost.decode_seconds(max(decode_tokens, heading))
        if decode_s is None or per_prefill is None or typical is None:
            return None
        budget = self.factor * typical if self.factor > 0 else math.inf
        if self.max_seconds > 0:
            budget = min(budget, self.max_seconds)
        self.last_seconds = budget
        return max(0, int((budget - decode_s) / per_prefill))

    def stats(self) -> dict[str, float | int]:
        """Its part of `SchedulerStats`, by field name."""
        return {"step_budget_seconds": self.last_seconds, "prefill_budget_tokens": self.last_tokens}
