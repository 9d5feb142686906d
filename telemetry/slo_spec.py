"""The latency thresholds of the SLO spec, `dashboards/slo.yaml` (the file the alerts are
generated from), for what judges requests by them at run time: tail sampling in the server,
goodput in the load tests.

The file is package data of `dashboards` (pyproject.toml), found with importlib.resources,
so an installed server reads the same file as a checkout; only its bytes are read, no code
of that package is used."""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml


def _packaged_spec() -> Traversable | None:
    """dashboards/slo.yaml where the `dashboards` package is (installed or a checkout); None without it."""
    try:
        return files("dashboards") / "slo.yaml"
    except ModuleNotFoundError:  # an install without the dashboards package
        return None


SLO_SPEC = _packaged_spec()


def spec_found(path: Traversable | Path | str | None = SLO_SPEC) -> bool:
    """Whether the SLO spec at `path` exists (the thresholds then come from it)."""
    return path is not None and (Path(path) if isinstance(path, str) else path).is_file()


def slo_spec_goodput(path: Traversable | Path | str | None = SLO_SPEC) -> tuple[dict[str, float], float | None]:
    """({ttft_ms, tpot_ms, e2e_ms present in the spec}, the strictest of their objectives) from the
    latency SLOs of dashboards/slo.yaml; ({}, None) when the file is absent.  The strictest
    objective, because a request counts as good only if it meets every threshold at once."""
    if not spec_found(path):
        return {}, None
    raw = yaml.safe_load((Path(path) if isinstance(path, str) else path).read_text()) or {}
    thresholds: dict[str, float] = {}
    objectives: list[float] = []
    for slo in (raw.get("slos") or {}).values():
        lat = (slo.get("sli") or {}).get("latency")
        if lat and lat.get("family") in ("ttft", "tpot", "e2e"):
            thresholds[f"{lat['family']}_ms"] = float(lat["threshold"]) * 1000.0
            objectives.append(float(slo["objective"]))
    return thresholds, max(objectives, default=None)
