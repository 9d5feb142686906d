"""What a run leaves behind: `summary.json` and a short text report (also printed).

The text puts client and server numbers side by side, so a mismatch is read at a glance.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.gate import Check
from loadtest.reconcile import Reconciliation
from loadtest.stats import Summary


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def summary_lines(s: Summary) -> list[str]:
    lines = [
        f"requests {s.requests}, failures {s.failures} (error rate {s.error_rate:.2%}), "
        f"{s.duration_s:.1f} s, {s.requests_per_s:.2f} req/s, {s.output_tokens_per_s:.1f} output tok/s, "
        f"goodput {s.goodput_per_s:.2f} req/s ({s.goodput_requests} requests within {s.goodput_slo or 'no SLO'})",
        f"finish reasons {s.finish_reasons}" + (f"; failures {s.failure_reasons}" if s.failure_reasons else ""),
        f"{'':10} {'n':>7} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}",
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = getattr(s.latency, name)
        lines.append(f"{name:10} {p.count:>7} {_ms(p.p50):>8} {_ms(p.p90):>8} {_ms(p.p99):>8} {_ms(p.max):>8}")
    if len(s.stages) > 1:
        lines.append(
            f"{'level':>8} {'reqs':>6} {'fail':>5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8}"
        )
        for st in s.stages:
            lt = st.latency
            lines.append(
                f"{st.level:>8g} {st.requests:>6} {st.failures:>5} {st.output_tokens_per_s:>8.1f} "
                f"{_ms(lt.ttft_ms.p50):>9} {_ms(lt.ttft_ms.p99):>9} {_ms(lt.itl_ms.p50):>8} "
                f"{_ms(lt.itl_ms.p99):>8}"
            )
    return lines


def reconciliation_lines(r: Reconciliation) -> list[str]:
    if not r.available:
        return [f"reconciliation: unavailable ({r.note})"]
    lines = [
        f"reconciliation {'OK' if r.ok else 'MISMATCH'} (client | server)",
        f"  requests by finish_reason: {r.client_by_finish_reason} | {r.server_by_finish_reason}"
        f"  {'match' if r.counts_match else 'DIFFER'}"
        + (f" ({r.client_unanswered} cut before any response)" if r.client_unanswered else ""),
        f"  by finish_reason/status:   {r.client_by_finish_reason_status} | {r.server_by_finish_reason_status}",
        f"  prompt tokens:     {r.client_prompt_tokens} | {r.server_prompt_tokens}",
        f"  generation tokens: {r.client_generation_tokens} | {r.server_generation_tokens}"
        f"  {'match' if r.tokens_match else 'DIFFER' if r.tokens_comparable else '(not compared)'}",
        f"  TTFT observations: {r.client_ttft_count} | {r.server_ttft_count}; server ≤ client at every bucket: "
        f"{r.server_ttft_le_client}",
    ]
    if r.prefix_cache_available:
        verdict = "match" if r.cached_tokens_match else "DIFFER" if r.tokens_comparable else "(not compared)"
        ratio = "—" if r.prefix_hit_ratio is None else f"{r.prefix_hit_ratio:.1%}"
        lines += [
            f"  cached tokens (usage | prefix-cache hits): {r.client_cached_tokens} | "
            f"{r.server_prefix_hits_tokens}  {verdict}",
            f"  prefix cache hit ratio: {ratio} ({r.server_prefix_hits_tokens} of "
            f"{r.server_prefix_queries_tokens} prompt tokens admitted)",
        ]
    for q, v in r.ttft_ms.items():
        lines.append(f"  TTFT {q} ms: {_ms(v['client'])} | {_ms(v['server_estimate'])} (bucket estimate)")
    if r.note:
        lines.append(f"  note: {r.note}")
    return lines


def gate_lines(checks: list[Check]) -> list[str]:
    if not checks:
        return ["SLO gate: no thresholds given (pass)"]
    return [f"SLO gate: {'PASS' if all(c.passed for c in checks) else 'FAIL'}", *("  " + c.line() for c in checks)]


def write_summary(
    path: Path, run: dict, s: Summary, r: Reconciliation, checks: list[Check], plots: list[Path], search: Any = None
) -> None:
    """`search`: a goodput search's SearchResult (its knee and steps under `goodput_search`)."""
    doc = {
        "run": run,
        **asdict(s),
        "reconciliation": {**asdict(r), "ok": r.ok},
        "slo_gate": {"passed": all(c.passed for c in checks), "checks": [asdict(c) for c in checks]},
        "plots": [p.name for p in plots],
    }
    if search is not None:
        doc["goodput_search"] = asdict(search)
    path.write_text(json.dumps(doc, indent=1))
