"""From request records to the numbers of `summary.json`: percentiles, throughput, goodput, stages.

Latency percentiles are over successful requests only (as vLLM's benchmark does); ITL
pools every gap of every request.  Goodput counts the successful requests that met
every per-request SLO given (`ttft_ms`, `tpot_ms`, `e2e_ms`; vLLM's `--goodput`),
divided by the run's duration.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadtest.records import RequestRecord, token_times

GOODPUT_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2e_ms": "e2e"}


@dataclass
class Percentiles:
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: list[float], scale: float = 1000.0) -> "Percentiles":
        """Seconds in, milliseconds out (scale=1 for counts)."""
        if not values:
            return cls(0)
        a = np.asarray(values, dtype=float) * scale
        p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
        return cls(len(a), float(a.mean()), p50, p90, p99, float(a.max()))


@dataclass
class Latencies:
    ttft_ms: Percentiles
    itl_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    output_tokens: Percentiles  # per successful request, in tokens

    @classmethod
    def of(cls, recs: list[RequestRecord]) -> "Latencies":
        ok = [r for r in recs if r.ok]
        return cls(
            Percentiles.of([r.ttft for r in ok if r.ttft is not None]),
            Percentiles.of([g for r in ok for g in r.itl]),
            Percentiles.of([r.tpot for r in ok if r.tpot is not None]),
            Percentiles.of([r.e2e for r in ok]),
            Percentiles.of([r.output_tokens for r in ok], scale=1.0),
        )


@dataclass
class StageSummary:
    stage: int
    level: float  # offered load: users or requests/s
    requests: int
    failures: int
    requests_per_s: float  # requests sent during the stage ÷ its length
    output_tokens_per_s: float  # every token streamed while the stage's load was offered (records.token_times)
    latency: Latencies


@dataclass
class Summary:
    requests: int
    failures: int
    error_rate: float
    duration_s: float
    requests_per_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float  # successful requests only (vLLM), over the whole run
    goodput_requests: int
    goodput_per_s: float
    goodput_slo: dict[str, float]
    finish_reasons: dict[str, int]
    failure_reasons: dict[str, int]
    latency: Latencies
    stages: list[StageSummary] = field(default_factory=list)


def meets(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request within every per-request SLO (a missing TPOT, n < 2, passes that one)."""
    if not rec.ok:
        return False
    for key, attr in GOODPUT_KEYS.items():
        value = getattr(rec, attr)
        if key in slo and value is not None and value * 1000.0 > slo[key]:
            return False
    return True


def run_window(recs: list[RequestRecord]) -> float:
    """First request sent → last request ended, seconds."""
    if not recs:
        return 0.0
    return max(r.start + r.e2e for r in recs) - min(r.start for r in recs)


def _tokens(recs: list[RequestRecord]) -> int:
    return sum(r.output_tokens for r in recs if r.ok)


def _stage_throughput(recs: list[RequestRecord], stage_seconds: float) -> dict[int, float]:
    """Output tokens/s that arrived while each stage's load was offered (whoever sent them)."""
    t0 = min(r.start for r in recs)
    out: Counter = Counter()
    for t, w in zip(*token_times(recs)):
        out[int((t - t0) // stage_seconds)] += w / stage_seconds
    return out


def summarize(recs: list[RequestRecord], goodput_slo: dict[str, float], stage_seconds: float) -> Summary:
    unknown = set(goodput_slo) - set(GOODPUT_KEYS)
    if unknown:
        raise ValueError(f"goodput SLO keys must be among {sorted(GOODPUT_KEYS)}, not {sorted(unknown)}")
    dur = run_window(recs)
    failures = sum(not r.ok for r in recs)
    good = sum(meets(r, goodput_slo) for r in recs)
    stages = []
    tok_s = _stage_throughput(recs, stage_seconds) if recs else {}
    for stage in sorted({r.stage for r in recs}):
        s = [r for r in recs if r.stage == stage]
        stages.append(
            StageSummary(
                stage,
                s[0].level,
                len(s),
                sum(not r.ok for r in s),
                len(s) / stage_seconds,
                tok_s.get(stage, 0.0),
                Latencies.of(s),
            )
        )
    return Summary(
        requests=len(recs),
        failures=failures,
        error_rate=failures / len(recs) if recs else 0.0,
        duration_s=dur,
        requests_per_s=len(recs) / dur if dur else 0.0,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in recs if r.ok),
        output_tokens=_tokens(recs),
        output_tokens_per_s=_tokens(recs) / dur if dur else 0.0,
        goodput_requests=good,
        goodput_per_s=good / dur if dur else 0.0,
        goodput_slo=dict(goodput_slo),
        finish_reasons=dict(Counter(r.finish_reason for r in recs)),
        failure_reasons=dict(Counter(r.error for r in recs if r.error)),
        latency=Latencies.of(recs),
        stages=stages,
    )
