"""Per-request latency objectives and whether each request met them (server-side goodput).

A request's objectives come from its headers, each field falling back to its tenant's (the
keys file's `slo_*_ms`); a request with none is not judged.  The header names are llm-d's
where llm-d has one (its router's admission and scoring plugins read the same headers, so
one header drives the gateway and the server's accounting):

    x-llm-d-slo-ttft-ms   (alias x-slo-ttft-ms, llm-d's earlier name)   time to first token
    x-llm-d-slo-tpot-ms   (alias x-slo-tpot-ms)                         time per output token
    x-sightline-slo-e2e-ms                                              end to end (llm-d has none)

Each is a number of milliseconds in (0, 86400000]; anything else is refused (`SLOHeaderError`,
a 400 that names the header).  When both a name and its alias are sent, the name wins.

At the request's end `judge` says, per objective, whether it was met: only a successful
request (finish reason stop or length) meets anything, so goodput counts requests served in
time, not merely answered.  TPOT is not judged for a successful request of fewer than two
output tokens (it has none).  `all` is the request as a whole: met when every judged
objective was; it is what server-side goodput counts (DistServe's and vLLM's `--goodput`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

from telemetry.outcomes import LENGTH, STOP

KINDS = ("ttft", "tpot", "e2e")
ALL = "all"
SLO_LABELS = KINDS + (ALL,)  # the `slo` label of sightline_request_slo_total
MAX_MS = 86_400_000.0
HEADERS: dict[str, tuple[str, ...]] = {  # objective → its header names, the first winning
    "ttft": ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"),
    "tpot": ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"),
    "e2e": ("x-sightline-slo-e2e-ms",),
}


class SLOHeaderError(ValueError):
    """A malformed objective header; `header` is its name."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True)
class Objectives:
    """Latency targets in seconds (None: no objective for that measure)."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))

    def over(self, fallback: "Objectives | None") -> "Objectives":
        """These objectives, each one not set taken from `fallback` (a tenant's)."""
        if fallback is None:
            return self
        return replace(fallback, **{k: getattr(self, k) for k in KINDS if getattr(self, k) is not None})

    @classmethod
    def from_ms(
        cls, ttft_ms: float | None = None, tpot_ms: float | None = None, e2e_ms: float | None = None
    ) -> "Objectives":
        return cls(*(None if v is None else v / 1000.0 for v in (ttft_ms, tpot_ms, e2e_ms)))


def parse_ms(header: str, raw: str) -> float:
    """One header's value in milliseconds, or SLOHeaderError naming the header."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not 0.0 < value <= MAX_MS:  # NaN fails too
        raise SLOHeaderError(
            header, f"{header} must be a number of milliseconds in (0, {MAX_MS:.0f}], not {raw[:40]!r}"
        )
    return value


def parse_headers(headers: Mapping[str, str]) -> Objectives:
    """The objectives a request's headers set (an empty `Objectives` when none is sent)."""
    found: dict[str, float] = {}
    for kind, names in HEADERS.items():
        for name in reversed(names):  # the canonical name, read last, wins over its alias
            raw = headers.get(name)
            if raw is not None:
                found[kind] = parse_ms(name, raw) / 1000.0
    return Objectives(**found)


def objective_headers(thresholds_ms: Mapping[str, float]) -> dict[str, str]:
    """The headers that carry objectives given in ms by `ttft_ms`, `tpot_ms`, `e2e_ms` (the load tests'
    goodput thresholds), so the server judges requests as the client does; other keys are ignored."""
    out = {}
    for key, ms in thresholds_ms.items():
        names = HEADERS.get(key.removesuffix("_ms"))
        if names and ms > 0:
            out[names[0]] = f"{ms:g}"
    return out


def judge(obj: Objectives, outcome: str, ttft: float | None, tpot: float | None, e2e: float) -> dict[str, bool]:
    """{objective: met} for the objectives judged, plus `all` when any was; {} without objectives."""
    ok = outcome in (STOP, LENGTH)
    met: dict[str, bool] = {}
    for kind, target, actual in (("ttft", obj.ttft, ttft), ("tpot", obj.tpot, tpot), ("e2e", obj.e2e, e2e)):
        if target is None:
            continue
        if kind == "tpot" and ok and actual is None:
            continue  # fewer than two output tokens: no TPOT to judge
        met[kind] = ok and actual is not None and actual <= target
    if met:
        met[ALL] = all(met.values())
    return met
