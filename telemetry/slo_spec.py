"""The latency thresholds of the SLO spec, `dashboards/slo.yaml` (the file the alerts are
generated from), for what judges requests by them at run time: tail sampling in the server,
goodput in the load tests."""

from __future__ import annotations

from pathlib import Path

import yaml

SLO_SPEC = Path(__file__).resolve().parent.parent / "dashboards" / "slo.yaml"


def slo_spec_goodput(path: Path = SLO_SPEC) -> tuple[dict[str, float], float | None]:
    """({ttft_ms, tpot_ms, e2e_ms present in the spec}, the strictest of their objectives) from the
    latency SLOs of dashboards/slo.yaml; ({}, None) when the file is absent.  The strictest
    objective, because a request counts as good only if it meets every threshold at once."""
    if not Path(path).is_file():
        return {}, None
    raw = yaml.safe_load(Path(path).read_text()) or {}
    thresholds: dict[str, float] = {}
    objectives: list[float] = []
    for slo in (raw.get("slos") or {}).values():
        lat = (slo.get("sli") or {}).get("latency")
        if lat and lat.get("family") in ("ttft", "tpot", "e2e"):
            thresholds[f"{lat['family']}_ms"] = float(lat["threshold"]) * 1000.0
            objectives.append(float(slo["objective"]))
    return thresholds, max(objectives, default=None)
