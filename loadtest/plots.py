"""PNG plots of a run: latency vs offered load (sweeps), latency CDFs, throughput over time, and a
goodput search's steps with its knee.

Throughput is counted when tokens arrive (`records.token_times`), not when requests end.
The search plot also writes what it drew into the PNG's text chunks (`sightline:knee`,
`sightline:steps`), so a test or a script reads the knee from the file, not from pixels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from loadtest.records import RequestRecord, token_times
from loadtest.stats import Summary


def _save(fig, path: Path, metadata: dict[str, str] | None = None) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=metadata)
    plt.close(fig)
    return path


def load_vs_latency(summary: Summary, arrival: str, path: Path) -> Path:
    """TTFT and ITL p50/p90/p99 against offered load, one point per stage."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    stages = sorted(summary.stages, key=lambda s: s.level)  # a search runs its levels out of order
    levels = [s.level for s in stages]
    xlabel = "concurrent users (closed loop)" if arrival == "closed" else "offered rate, requests/s (Poisson)"
    for ax, metric in zip(axes[:2], ("ttft_ms", "itl_ms")):
        for q in ("p50", "p90", "p99"):
            ax.plot(levels, [getattr(getattr(s.latency, metric), q) or np.nan for s in stages], marker="o", label=q)
        ax.set(title=f"{metric[:-3].upper()} vs offered load", xlabel=xlabel, ylabel="ms")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[2].plot(levels, [s.output_tokens_per_s for s in stages], marker="o", color="tab:green")
    axes[2].set(title="output tokens/s vs offered load", xlabel=xlabel, ylabel="tokens/s")
    axes[2].grid(alpha=0.3)
    return _save(fig, path)


def latency_cdfs(recs: list[RequestRecord], path: Path) -> Path:
    ok = [r for r in recs if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok if r.ttft is not None],
        "ITL (pooled gaps)": [g for r in ok for g in r.itl],
        "TPOT (per request)": [r.tpot for r in ok if r.tpot is not None],
        "e2e": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, values) in zip(axes.flat, series.items()):
        v = np.sort(np.asarray(values, dtype=float) * 1000)
        if len(v):
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post")
            for q in (50, 90, 99):
                ax.axhline(q / 100, color="grey", lw=0.5, ls=":")
        ax.set(title=f"{name} CDF (n={len(v)})", xlabel="ms", ylabel="fraction ≤ x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    return _save(fig, path)


def throughput_over_time(
    recs: list[RequestRecord], stage_seconds: float, levels: tuple[float, ...], path: Path
) -> Path:
    """Output tokens/s and completed requests/s in 1 s bins, with the offered level behind them."""
    t0 = min((r.start for r in recs), default=0.0)
    end = max((r.start + r.e2e - t0 for r in recs), default=1.0)
    bins = np.arange(0, int(np.ceil(end)) + 1.0)
    tok_t, tok_w = token_times(recs)
    tokens, _ = np.histogram(np.asarray(tok_t) - t0, bins=bins, weights=tok_w or None)
    done, _ = np.histogram([r.start - t0 + r.e2e for r in recs], bins=bins)
    failed, _ = np.histogram([r.start - t0 + r.e2e for r in recs if not r.ok], bins=bins)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    ax1.plot(bins[:-1], tokens, color="tab:green")
    ax1.set(title="output tokens/s", ylabel="tokens/s")
    ax2.plot(bins[:-1], done, label="completed")
    ax2.plot(bins[:-1], failed, label="failed", color="tab:red")
    ax2.set(title="requests/s", xlabel="seconds since the first request", ylabel="requests/s")
    ax2.legend(loc="upper left")
    level_ax = ax1.twinx()
    level_ax.step(
        [i * stage_seconds for i in range(len(levels) + 1)],
        [*levels, levels[-1]],
        where="post",
        color="grey",
        alpha=0.5,
    )
    level_ax.set_ylabel("offered load", color="grey")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def goodput_search(result: Any, path: Path) -> Path:
    """Share of requests within the SLO and goodput against the level of each step (in level order,
    pass/fail coloured), the objective as a line, the knee as a vertical line on both."""
    steps = sorted(result.steps, key=lambda s: s.level)
    levels = [s.level for s in steps]
    colours = ["tab:green" if s.passed else "tab:red" for s in steps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax1.plot(levels, [np.nan if s.attainment is None else 100 * s.attainment for s in steps], color="grey", lw=0.8)
    ax1.scatter(levels, [0 if s.attainment is None else 100 * s.attainment for s in steps], c=colours, zorder=3)
    ax1.axhline(100 * result.objective, color="tab:blue", ls="--", label=f"objective {result.objective:.1%}")
    ax1.set(title="requests within the SLO", xlabel=result.unit, ylabel="%", ylim=(-2, 102))
    ax2.plot(levels, [s.requests_per_s for s in steps], marker=".", color="grey", label="sent")
    ax2.plot(levels, [s.goodput_per_s for s in steps], marker="o", color="tab:green", label="goodput")
    ax2.set(title="goodput vs load", xlabel=result.unit, ylabel="requests/s")
    drawn = None
    for ax in (ax1, ax2):
        if result.knee is not None:
            line = ax.axvline(result.knee, color="tab:orange", lw=2, label=f"knee {result.knee:g} {result.unit}")
            drawn = float(line.get_xdata()[0])
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left" if ax is ax1 else "upper left")
    slo = ", ".join(f"{k[:-3]} ≤ {v:g} ms" for k, v in result.goodput_slo.items()) or "no threshold"
    fig.suptitle(f"goodput search: ≥ {result.objective:.1%} of requests within {slo}")
    steps_drawn = [
        {"level": s.level, "attainment": s.attainment, "goodput_per_s": s.goodput_per_s, "passed": s.passed}
        for s in steps
    ]
    return _save(
        fig,
        path,
        {
            "sightline:knee": "none" if drawn is None else f"{drawn:g}",
            "sightline:unit": result.unit,
            "sightline:steps": json.dumps(steps_drawn),
        },
    )


def write_all(
    recs: list[RequestRecord],
    summary: Summary,
    arrival: str,
    stage_seconds: float,
    levels: tuple[float, ...],
    out: Path,
    search: Any = None,
) -> list[Path]:
    """The plots of a run; a goodput search's steps are separate runs with gaps between them, so it
    gets its own plot instead of the throughput-over-time one."""
    common = [
        load_vs_latency(summary, arrival, out / "load_vs_latency.png"),
        latency_cdfs(recs, out / "latency_cdf.png"),
    ]
    if search is not None:
        return [*common, goodput_search(search, out / "goodput_search.png")]
    return [*common, throughput_over_time(recs, stage_seconds, levels, out / "throughput.png")]
