"""One markdown table from `make bench`'s JSON: our engine, our HTTP server and the peers.

    .venv/bin/python -m bench.table [--dir results/bench]

Reads engine.json (bench.engine: output tok/s per precision mode, in-process, no streaming),
http.json and http-*.json (bench.http: our server over HTTP, one file per server precision
mode) and peers.json (bench.peers), whichever exist,
and prints them in the same columns; TTFT and ITL are measured by the same client code for
our server and the peers.  Skipped peers are listed under the table with their reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import summary

HEAD = ("| server | precision | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms |\n"
        "|---|---|---:|---:|---:|---:|---:|")


def _row(server: str, precision: str, n, tok_s: float, s: dict | None = None) -> str:
    cells = [f"{s['ttft_p50_ms']:.0f}", f"{s['itl_p50_ms']:.1f}", f"{s['itl_p99_ms']:.1f}"] if s else ["–"] * 3
    return f"| {server} | {precision} | {n} | {tok_s:.1f} | " + " | ".join(cells) + " |"


def render(engine: dict | None, https: list[dict], peers: dict | None) -> str:
    lines, notes = [HEAD], []
    if engine:
        notes.append(f"engine: {engine['prompt_len']}-token prompts, {engine['gen_len']} new tokens per request")
        for r in engine["rows"]:
            attention = r.get("attention", "auto")
            precision = r["mode"] + ("" if attention == "auto" else f", {attention} attention")
            lines.append(_row("sightline engine, in-process", precision, r["concurrency"], r["out_tok_s"]))
    for http in https:
        info = http.get("engine_info") or {}
        precision = "+".join(v for k, v in sorted(info.items()) if v != "none") or "?"
        flags = " ".join(http.get("server_args") or [])
        notes.append(f"HTTP: {http['prompt_len']}-token prompts, {http['gen_len']} new tokens per request")
        for n, level in http["levels"].items():
            if "http" in level:
                lines.append(_row("sightline HTTP" + (f" ({flags})" if flags else ""), precision, n,
                                  level["http"]["tok_s"], summary(level["http"])))
    if peers:
        notes.append(f"peers: {peers['prompt_len']}-token prompts, {peers['gen_len']} new tokens per request")
        for name, p in peers["peers"].items():
            if "skipped" in p:
                notes.append(f"{name}: skipped: {p['skipped']}")
                continue
            for n, level in p["levels"].items():
                lines.append(_row(p["label"], p["precision"], n, level["tok_s"], summary(level)))
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("results/bench"))
    a = ap.parse_args(argv)

    def load(name: str) -> dict | None:
        path = a.dir / name
        return json.loads(path.read_text()) if path.is_file() else None

    https = [json.loads(p.read_text()) for p in sorted(a.dir.glob("http*.json"))]
    print(render(load("engine.json"), https, load("peers.json")))


if __name__ == "__main__":
    main()
