"""The SLO spec (`dashboards/slo.yaml`), loaded and checked once.

Everything the rules and their tests need comes from here, so a threshold or an
objective changes in one place.  A latency threshold that is not a bucket boundary
would make `_bucket{le="T"}` select nothing and the SLI silently read 100 % bad, so
loading refuses it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.utils import floatToGoString

from telemetry.metrics import BY_NAME, DEFAULT_BUCKETS

SPEC_PATH = Path(__file__).with_name("slo.yaml")
# Aggregation level of every SLO series: what `sum by` keeps.
SLO_LEVEL = ("job", "model_name")
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def seconds(duration: str) -> int:
    m = _DURATION.match(str(duration))
    if not m:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return int(m.group(1)) * _SECONDS[m.group(2)]


@dataclass(frozen=True)
class Window:
    long: str
    short: str
    factor: float


@dataclass(frozen=True)
class SLO:
    name: str
    alert: str
    objective: float
    description: str
    metric: str
    bad_matcher: str = ""  # errors SLI: matcher selecting the bad events
    le: str = ""  # latency SLI: the bucket boundary, as prometheus_client writes it

    @property
    def budget(self) -> float:
        return round(1 - self.objective, 10)

    @property
    def kind(self) -> str:
        return "latency" if self.le else "errors"


@dataclass(frozen=True)
class Spec:
    period: str
    job: str
    runbook: str
    slos: tuple[SLO, ...]
    burn_rates: dict[str, tuple[Window, ...]]
    symptoms: dict[str, dict]

    def windows(self) -> list[str]:
        """Every window a burn-rate alert reads, shortest first."""
        ws = {w for pairs in self.burn_rates.values() for p in pairs for w in (p.long, p.short)}
        return sorted(ws, key=seconds)

    def runbook_url(self, alert: str) -> str:
        return f"{self.runbook}#{alert.lower()}"


def _slo(name: str, raw: dict) -> SLO:
    objective = float(raw["objective"])
    if not 0 < objective < 1:
        raise ValueError(f"SLO {name}: objective must be in (0, 1), got {objective}")
    sli = raw["sli"]
    common = dict(name=name, alert=raw["alert"], objective=objective, description=raw["description"])
    if "errors" in sli:
        metric = sli["errors"]["metric"]
        _require(metric, "counter", name)
        return SLO(metric=metric, bad_matcher=sli["errors"]["bad"], **common)
    lat = sli["latency"]
    metric, family, threshold = lat["metric"], lat["family"], float(lat["threshold"])
    _require(metric, "histogram", name)
    if threshold not in DEFAULT_BUCKETS[family]:
        raise ValueError(
            f"SLO {name}: threshold {threshold} is not a bucket boundary of {family!r} "
            f"({', '.join(map(str, DEFAULT_BUCKETS[family]))})"
        )
    return SLO(metric=metric, le=floatToGoString(threshold), **common)


def _require(metric: str, kind: str, slo: str) -> None:
    spec = BY_NAME.get(metric)
    if spec is None or spec.kind != kind:
        raise ValueError(f"SLO {slo}: {metric} is not a {kind} in telemetry/metrics.py SPECS")


def load(path: Path = SPEC_PATH, overrides: dict | None = None) -> Spec:
    """Read the spec; `overrides` replaces symptom settings (the live test's small thresholds)."""
    raw = yaml.safe_load(Path(path).read_text())
    symptoms = copy.deepcopy(raw["symptoms"])
    for alert, values in (overrides or {}).items():
        if alert not in symptoms:
            raise KeyError(f"no symptom alert {alert!r} in {path}")
        symptoms[alert].update(values)
    burn = {
        sev: tuple(Window(str(w["long"]), str(w["short"]), float(w["factor"])) for w in ws)
        for sev, ws in raw["burn_rates"].items()
    }
    for sev, ws in burn.items():
        for w in ws:
            if seconds(w.short) * 12 != seconds(w.long):
                raise ValueError(f"{sev}: short window {w.short} should be 1/12 of {w.long}")
    seconds(raw["period"])
    return Spec(
        period=raw["period"],
        job=raw["job"],
        runbook=raw["runbook"],
        slos=tuple(_slo(n, s) for n, s in raw["slos"].items()),
        burn_rates=burn,
        symptoms=symptoms,
    )
