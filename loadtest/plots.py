"""PNG plots of a run: latency vs offered load (sweeps), latency CDFs, throughput over time.

Throughput is counted when tokens arrive (`records.token_times`), not when requests end.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.records import RequestRecord, token_times  # noqa: E402
from loadtest.stats import Summary  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_vs_latency(summary: Summary, arrival: str, path: Path) -> Path:
    """TTFT and ITL p50/p90/p99 against offered load, one point per stage."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    levels = [s.level for s in summary.stages]
    xlabel = "concurrent users (closed loop)" if arrival == "closed" else "offered rate, requests/s (Poisson)"
    for ax, metric in zip(axes[:2], ("ttft_ms", "itl_ms")):
        for q in ("p50", "p90", "p99"):
            ax.plot(levels, [getattr(getattr(s.latency, metric), q) or np.nan for s in summary.stages],
                    marker="o", label=q)
        ax.set(title=f"{metric[:-3].upper()} vs offered load", xlabel=xlabel, ylabel="ms")
        ax.legend()
        ax.grid(alpha=0.3)
    axes[2].plot(levels, [s.output_tokens_per_s for s in summary.stages], marker="o", color="tab:green")
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


def throughput_over_time(recs: list[RequestRecord], stage_seconds: float, levels: tuple[float, ...],
                         path: Path) -> Path:
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
    level_ax.step([i * stage_seconds for i in range(len(levels) + 1)], [*levels, levels[-1]], where="post",
                  color="grey", alpha=0.5)
    level_ax.set_ylabel("offered load", color="grey")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def write_all(recs: list[RequestRecord], summary: Summary, arrival: str, stage_seconds: float,
              levels: tuple[float, ...], out: Path) -> list[Path]:
    return [load_vs_latency(summary, arrival, out / "load_vs_latency.png"),
            latency_cdfs(recs, out / "latency_cdf.png"),
            throughput_over_time(recs, stage_seconds, levels, out / "throughput.png")]
