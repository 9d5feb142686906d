"""Histogram bucket bounds, shared by the main process's histograms and the Scheduler's
step-phase histograms (no Prometheus import: the Scheduler keeps its own counts)."""

from __future__ import annotations

# Fine below 100 ms (SLO thresholds must be bucket boundaries), long enough for minutes.
DEFAULT_BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.15,
        0.2,
        0.25,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        7.5,
        10.0,
        15.0,
        20.0,
        30.0,
        60.0,
        120.0,
        300.0,
        600.0,
    ),
    "itl": (
        0.001,
        0.0025,
        0.005,
        0.01,
        0.02,
        0.03,
        0.04,
        0.05,
        0.06,
        0.075,
        0.1,
        0.125,
        0.15,
        0.2,
        0.25,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
        60.0,
    ),
    "e2e": (
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.0,
        3.0,
        5.0,
        7.5,
        10.0,
        15.0,
        20.0,
        30.0,
        45.0,
        60.0,
        90.0,
        120.0,
        180.0,
        300.0,
        600.0,
        1200.0,
        2400.0,
    ),
    "stage": (
        0.0001,
        0.00025,
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1.0,
        2.5,
        5.0,
        10.0,
        30.0,
        60.0,
        120.0,
        300.0,
        600.0,
    ),
    "tokens": tuple(float(2**i) for i in range(16)),  # 1 … 32768
    "startup": (0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0),
}
DEFAULT_BUCKETS["tpot"] = DEFAULT_BUCKETS["itl"]


def parse_bucket_overrides(text: str | None) -> dict[str, tuple[float, ...]]:
    """`--histogram-buckets "ttft=0.05,0.1,0.2;itl=0.01,0.05"` → {family: buckets}."""
    out: dict[str, tuple[float, ...]] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        key, _, values = part.partition("=")
        key = key.strip()
        if key not in DEFAULT_BUCKETS:
            raise ValueError(
                f"--histogram-buckets: unknown family {key!r} (known: {', '.join(sorted(DEFAULT_BUCKETS))})"
            )
        try:
            buckets = tuple(float(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"--histogram-buckets: {key}: bucket bounds must be numbers") from None
        if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"--histogram-buckets: {key}: bounds must be positive and strictly increasing")
        out[key] = buckets
    return out
