"""The report of a replay (`python -m loadtest --replay`): each replayed request paired with
its recorded one (TTFT, TPOT, e2e as the server measured them, beside the client's view),
quantiles before vs after, outcomes before vs after, and a before/after plot."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from loadtest.records import RequestRecord as ClientRecord
from loadtest.replay.schedule import LATE_S, SENT_FILE, SUCCESS, ReplayItem
from loadtest.stats import Percentiles
from telemetry.outcomes import refused_outcome
from telemetry.request_record import RequestRecord


def client_outcome(r: ClientRecord) -> str:
    """The outcome as the client saw it, named as the server names outcomes (telemetry/outcomes.py)."""
    if r.ok:
        return r.finish_reason
    if r.error and r.error.startswith("http "):
        code = r.error.split()[2] if len(r.error.split()) > 2 else None
        return refused_outcome(r.status, code)
    if r.error and r.error.startswith("error event"):
        return {500: "error", 503: "unavailable", 504: "timeout"}.get(r.status, "error")
    if r.status == 499:
        return "client_disconnect"
    return "connection_error" if not r.status else "error"


def _tpot_ms(ttft_ms: float | None, e2e_ms: float | None, n: int | None) -> float | None:
    if ttft_ms is None or e2e_ms is None or not n or n < 2:
        return None
    return (e2e_ms - ttft_ms) / (n - 1)


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def pair(planned: list[tuple[RequestRecord, float]], items: list[ReplayItem], sent: list[dict]) -> list[dict]:
    """One row per replayed record: recorded vs replayed (server-side and client-side), matched by
    the schedule's index."""
    by_index = {s["index"]: s for s in sent}
    rows = []
    for (rec, due), item in zip(planned, items):
        s = by_index.get(item.index)
        bd = rec.breakdown or {}
        row = {
            "index": item.index,
            "rid": rec.rid,
            "route": rec.route,
            "stream": rec.stream,
            "prompt": item.prompt_source,
            "due_s": _r(due),
            "recorded": {
                "outcome": rec.outcome,
                "prompt_tokens": rec.prompt_tokens,
                "completion_tokens": rec.completion_tokens,
                "ttft_ms": bd.get("ttft_ms"),
                "tpot_ms": bd.get("tpot_ms"),
                "e2e_ms": bd.get("e2e_ms"),
            },
            "sent": s is not None,
        }
        if s is not None:
            c = ClientRecord(**s["record"])
            srv = s.get("server") or {}
            n = c.completion_tokens
            row.update(
                sent_s=_r(s["sent_s"]),
                late_ms=_r(max(0.0, s["sent_s"] - s["due_s"]) * 1000, 1),
                request_id=s.get("request_id"),
            )
            row["replayed"] = {
                "outcome": client_outcome(c),
                "error": c.error,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": n,
                "server": {
                    "ttft_ms": srv.get("ttft_ms"),
                    "tpot_ms": _r(_tpot_ms(srv.get("ttft_ms"), srv.get("e2e_ms"), n)),
                    "e2e_ms": srv.get("e2e_ms"),
                }
                if srv
                else None,
                "client": {
                    "ttft_ms": _r(c.ttft and c.ttft * 1000),
                    "tpot_ms": _r(c.tpot and c.tpot * 1000),
                    "e2e_ms": _r(c.e2e * 1000),
                    "itl_ms": [_r(g * 1000) for g in c.itl],
                },
            }
        rows.append(row)
    return rows


def _pct(values: list[float]) -> dict:
    return asdict(Percentiles.of([v for v in values if v is not None], scale=1.0))


def summarize_rows(
    rows: list[dict], all_records: list[RequestRecord], skipped: list[tuple[RequestRecord, str]], run: dict
) -> dict:
    """Quantiles before vs after (latencies over the requests that finished stop/length on that
    side), outcome counts, and how closely the sends followed the schedule."""
    rec_ok = [r["recorded"] for r in rows if r["recorded"]["outcome"] in SUCCESS]
    rep = [r["replayed"] for r in rows if r["sent"]]
    rep_ok = [x for x in rep if x["outcome"] in SUCCESS]
    latency = {}
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        latency[key] = {
            "recorded": _pct([x[key] for x in rec_ok]),
            "replayed_server": _pct([x["server"][key] for x in rep_ok if x["server"]]),
            "replayed_client": _pct([x["client"][key] for x in rep_ok]),
        }
    latency["itl_ms"] = {"replayed_client": _pct([g for x in rep_ok for g in x["client"]["itl_ms"]])}
    late = [r["late_ms"] for r in rows if r["sent"]]
    span_rec = max((r["due_s"] for r in rows), default=0.0)
    span_sent = max((r["sent_s"] for r in rows if r["sent"]), default=0.0)
    return {
        "run": run,
        "records": len(all_records),
        "replayed": len(rows),
        "sent": len(rep),
        "skipped": len(skipped),
        "skipped_reasons": dict(Counter(why for _, why in skipped)),
        "outcomes": {
            "recorded_all": dict(Counter(r.outcome for r in all_records)),
            "recorded": dict(Counter(r["recorded"]["outcome"] for r in rows)),
            "replayed": dict(Counter(x["outcome"] for x in rep)),
        },
        "schedule": {
            "late_threshold_ms": LATE_S * 1000,
            "late": sum(v > LATE_S * 1000 for v in late),
            "lateness_ms": _pct(late),
            "last_due_s": span_rec,
            "last_sent_s": span_sent,
        },
        "prompt_tokens_match": sum(
            1 for r in rows if r["sent"] and r["replayed"]["prompt_tokens"] == r["recorded"]["prompt_tokens"]
        ),
        "completion_tokens_match": sum(
            1 for r in rows if r["sent"] and r["replayed"]["completion_tokens"] == r["recorded"]["completion_tokens"]
        ),
        "latency": latency,
    }


def _f(v: float | None, w: int = 7) -> str:
    return f"{'—':>{w}}" if v is None else f"{v:>{w}.1f}"


def report_lines(doc: dict, max_rows: int = 40) -> list[str]:
    run, sch = doc["run"], doc["schedule"]
    lines = [
        f"replay of {run['dump']}: {doc['records']} records, {doc['replayed']} replayed, {doc['sent']} sent, "
        f"{doc['skipped']} skipped {doc['skipped_reasons'] or ''}".rstrip(),
        f"  speed ×{run['speed']:g}, max_tokens {run['max_tokens']}, {run['users']} users, against {run['url']}",
        f"schedule: last due {sch['last_due_s']:.2f} s, last sent {sch['last_sent_s']:.2f} s; lateness p50 "
        f"{_f(sch['lateness_ms']['p50'], 0)} ms, p99 {_f(sch['lateness_ms']['p99'], 0)} ms, max "
        f"{_f(sch['lateness_ms']['max'], 0)} ms; {sch['late']} sent > {sch['late_threshold_ms']:g} ms late",
        f"tokens as recorded: prompt {doc['prompt_tokens_match']}/{doc['sent']}, "
        f"completion {doc['completion_tokens_match']}/{doc['sent']}",
        f"{'':8} {'recorded (server)':>29} | {'replayed (server)':>29} | {'replayed (client)':>29}",
        f"{'':8} " + " | ".join([f"{'n':>5} {'p50':>7} {'p90':>7} {'p99':>7}"] * 3),
    ]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms"):
        cols = []
        for side in ("recorded", "replayed_server", "replayed_client"):
            p = doc["latency"][key].get(side)
            cols.append(
                f"{'':>5} {'':>7} {'':>7} {'':>7}"
                if p is None
                else f"{p['count']:>5} {_f(p['p50'])} {_f(p['p90'])} {_f(p['p99'])}"
            )
        lines.append(f"{key:8} " + " | ".join(cols))
    o = doc["outcomes"]
    lines.append(f"outcomes: recorded {o['recorded']} → replayed {o['replayed']} (whole dump: {o['recorded_all']})")
    rows = doc["requests"]
    lines.append(
        f"{'#':>4} {'route':<20} {'due s':>7} {'late ms':>7}  {'TTFT ms rec→rep':>17}  "
        f"{'TPOT ms rec→rep':>15}  {'e2e ms rec→rep':>17}  outcome"
    )
    for r in rows[:max_rows]:
        rec, rep = r["recorded"], r.get("replayed")
        srv = (rep or {}).get("server") or {}
        lines.append(
            f"{r['index']:>4} {r['route']:<20} {r['due_s']:>7.2f} {_f(r.get('late_ms'))}  "
            f"{_f(rec['ttft_ms'])}→{_f(srv.get('ttft_ms'), 8)}  "
            f"{_f(rec['tpot_ms'], 6)}→{_f(srv.get('tpot_ms'), 7)}"
            f"  {_f(rec['e2e_ms'])}→{_f(srv.get('e2e_ms'), 8)}  {rec['outcome']}→"
            f"{rep['outcome'] if rep else 'NOT SENT'}"
        )
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more in replay.json")
    return lines


def plot(doc: dict, path: Path) -> Path:
    """CDFs of TTFT, TPOT and e2e: recorded vs replayed (server and client), and each request's send
    lateness against its due time.  The PNG's text chunk `sightline:replay` holds the counts drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = doc["requests"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    sides = (
        ("recorded", "recorded (server)", "tab:grey"),
        ("server", "replayed (server)", "tab:blue"),
        ("client", "replayed (client)", "tab:orange"),
    )
    drawn = {}
    for ax, key in zip(axes.flat, ("ttft_ms", "tpot_ms", "e2e_ms")):
        for side, label, colour in sides:
            if side == "recorded":
                vals = [r["recorded"][key] for r in rows if r["recorded"]["outcome"] in SUCCESS]
            else:
                vals = [
                    ((r["replayed"][side] or {}).get(key))
                    for r in rows
                    if r["sent"] and r["replayed"]["outcome"] in SUCCESS
                ]
            v = np.sort(np.asarray([x for x in vals if x is not None], dtype=float))
            drawn[f"{key}:{side}"] = len(v)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} n={len(v)}", color=colour)
        ax.set(title=f"{key[:-3].upper()} CDF, before vs after", xlabel="ms", ylabel="fraction ≤ x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    ax = axes.flat[3]
    sent = [r for r in rows if r["sent"]]
    ax.scatter([r["due_s"] for r in sent], [r["late_ms"] for r in sent], s=12)
    ax.axhline(LATE_S * 1000, color="tab:red", ls="--", lw=0.8, label=f"late (> {LATE_S * 1000:g} ms)")
    ax.set(
        title=f"send lateness (speed ×{doc['run']['speed']:g})",
        xlabel="due, s after the start",
        ylabel="sent − due, ms",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"replay of {Path(doc['run']['dump']).name}: {doc['sent']} of {doc['replayed']} requests sent")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"sightline:replay": json.dumps({"sent": doc["sent"], **drawn})})
    plt.close(fig)
    return path


def analyse(
    out: Path,
    dump: Path,
    all_records: list[RequestRecord],
    planned: list[tuple[RequestRecord, float]],
    skipped: list[tuple[RequestRecord, str]],
    items: list[ReplayItem],
    run: dict,
) -> dict:
    """replay.json, replay.txt and replay.png from what the run left in `out`."""
    sent_path = out / SENT_FILE
    lines = sent_path.read_text().splitlines() if sent_path.exists() else []
    sent = [json.loads(line) for line in lines if line.strip()]
    rows = pair(planned, items, sent)
    doc = summarize_rows(rows, all_records, skipped, {**run, "dump": str(dump)})
    doc["skipped_records"] = [{"rid": r.rid, "route": r.route, "outcome": r.outcome, "why": why} for r, why in skipped]
    doc["requests"] = rows
    doc["plot"] = plot(doc, out / "replay.png").name if rows else None
    (out / "replay.json").write_text(json.dumps(doc, indent=1))
    text = "\n".join([*report_lines(doc), f"results: {out}"])
    (out / "replay.txt").write_text(text + "\n")
    doc["text"] = text
    return doc
