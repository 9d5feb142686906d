"""The SLO gate: thresholds on a Summary that decide the exit code (CI and release scripts).

Keys: `<ttft|itl|tpot|e2e>_<p50|p90|p99|mean|max>_ms` (an upper bound), `error_rate`
(upper bound, a fraction), `goodput_min` (lower bound, good requests/s),
`output_tokens_per_s_min` and `requests_per_s_min` (lower bounds), `prefix_hit_ratio_min`
(lower bound on the server's prefix-cache hits ÷ queries over the run, from the
reconciliation), `goodput_knee_min` (lower bound on a goodput search's knee, in its unit:
requests/s or users).  A check with no data to judge (no successful request, no prefix-cache
counters on the server, no search or no level that met the SLO) fails: a gate must not
pass on nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loadtest.config import ConfigError
from loadtest.stats import Summary

_LATENCY = re.compile(r"^(ttft|itl|tpot|e2e)_(p50|p90|p99|mean|max)_ms$")
_MINIMA = {
    "goodput_min": "goodput_per_s",
    "output_tokens_per_s_min": "output_tokens_per_s",
    "requests_per_s_min": "requests_per_s",
}
PREFIX_HIT_RATIO_MIN = "prefix_hit_ratio_min"  # judged on the reconciliation, not the Summary
GOODPUT_KNEE_MIN = "goodput_knee_min"  # judged on a goodput search's result


@dataclass
class Check:
    name: str
    op: str  # "<=" | ">="
    threshold: float
    actual: float | None
    passed: bool

    def line(self) -> str:
        actual = "no data" if self.actual is None else f"{self.actual:.4g}"
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {actual} {self.op} {self.threshold:g}"


def check_keys(slo: dict[str, float]) -> None:
    """ConfigError for an unknown key: caught before a run, not after it."""
    for key in slo:
        if not (_LATENCY.match(key) or key in ("error_rate", PREFIX_HIT_RATIO_MIN, GOODPUT_KNEE_MIN) or key in _MINIMA):
            raise ConfigError(
                f"unknown SLO {key!r}: use <ttft|itl|tpot|e2e>_<p50|p90|p99|mean|max>_ms, "
                f"error_rate, {', '.join(_MINIMA)}, {PREFIX_HIT_RATIO_MIN}, {GOODPUT_KNEE_MIN}"
            )


def actual_value(
    summary: Summary, key: str, prefix_hit_ratio: float | None = None, knee: float | None = None
) -> tuple[str, float | None]:
    """(comparison, the run's value) for a threshold key."""
    check_keys({key: 0.0})
    if key == PREFIX_HIT_RATIO_MIN:
        return ">=", prefix_hit_ratio
    if key == GOODPUT_KNEE_MIN:
        return ">=", knee
    if m := _LATENCY.match(key):
        return "<=", getattr(getattr(summary.latency, f"{m[1]}_ms"), m[2])
    if not summary.requests:
        return ("<=" if key == "error_rate" else ">="), None
    if key == "error_rate":
        return "<=", summary.error_rate
    return ">=", getattr(summary, _MINIMA[key])


def evaluate(
    summary: Summary, slo: dict[str, float], prefix_hit_ratio: float | None = None, knee: float | None = None
) -> list[Check]:
    """One check per threshold; `prefix_hit_ratio` is the reconciliation's, `knee` a goodput search's
    (None: not known)."""
    checks = []
    for key, threshold in sorted(slo.items()):
        op, actual = actual_value(summary, key, prefix_hit_ratio, knee)
        ok = actual is not None and (actual <= threshold if op == "<=" else actual >= threshold)
        checks.append(Check(key, op, float(threshold), actual, ok))
    return checks


def parse_pairs(items: list[str], flag: str, example: str = "") -> dict[str, float]:
    """Repeated `FLAG KEY=NUMBER` options → {key: value}."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"{flag} {item!r}: want KEY=NUMBER{', e.g. ' + example if example else ''}")
    return out


def parse_slo_args(items: list[str]) -> dict[str, float]:
    """`--slo ttft_p99_ms=500 --slo error_rate=0.01` → {key: value}."""
    return parse_pairs(items, "--slo", "ttft_p99_ms=500")
