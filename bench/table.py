"""One markdown table from `make bench`'s JSON: our engine and HTTP server beside the peers, precision by precision.

    .venv/bin/python -m bench.table [--dir results/bench] [--peers results/bench/peers.json]

Reads engine.json (bench.engine: output tok/s per precision mode, in-process, no streaming),
http.json and http-*.json (bench.http: our server over HTTP, one file per server precision
mode) and peers.json (bench.peers: transformers serve and llama-server, plus every server's
prompt processing), whichever exist.  Rows are grouped by the precision pair they compare:

* float32: our engine and server in float32 beside llama-server on an F32 GGUF and
  transformers serve in float32;
* GGUF Q8_0, GGUF Q4_K_M, GGUF Q4_1: our server on a GGUF file served in its own types
  (`--quantization gguf`, the default for a GGUF file) beside llama-server on the same file
  (Q8_0 and Q4_K_M made by llama.cpp's own `llama-quantize`, Q4_1 the bundled file);

and any other mode (bfloat16, `--quantization int8`) after them.  Within a pair, each concurrency's rows sit
together, with each server's output tok/s also as a multiple of our HTTP server's, and a
`pp` row last (a lone `pp_len`-token prompt, max_tokens 1: prompt tokens ÷ TTFT).  TTFT and
ITL are measured by the same client code for our server and the peers.  Missing files and
skipped peers are one line each under the table, with the reason.  Then embeddings.json
(bench.embeddings: the bundled MiniLM's embeddings/s at each batch size beside transformers in-process) and
speculative.json (bench.speculative: one stream's tok/s with prompt-lookup speculation on and off) and
speculative_peers.json (bench.speculative_peers: the same prompts over HTTP beside llama-server's speculation).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import summary
from bench.embeddings import embedding_lines
from bench.speculative import speculative_lines, speculative_peers_lines

HEAD = (
    "| pair | concurrency | server | precision | output tok/s | × sightline HTTP | TTFT p50 ms | ITL p50 ms "
    "| ITL p99 ms |\n"
    "|---|---:|---|---|---:|---:|---:|---:|---:|"
)
GGUF_PAIRS = ("GGUF Q8_0", "GGUF Q4_K_M", "GGUF Q4_1")
PAIR_ORDER = ("float32", *GGUF_PAIRS, "int8")
HTTP = "sightline HTTP"


def gguf_pair(model: str) -> str:
    """The pair of a GGUF file served in its own types, by the type its name says (llama.cpp's naming)."""
    name = Path(model).name.upper()
    return next((p for p in GGUF_PAIRS if p.split()[1] in name), "GGUF")


def _pair_of_http(http: dict) -> str:
    """Which pair one http*.json belongs to: the GGUF file's type when served in its own types, the
    quantization mode when quantized at load, else the dtype it computed in."""
    info = http.get("engine_info") or {}
    args = " ".join(http.get("server_args") or [])
    if info.get("quantization") == "gguf":
        return gguf_pair(http.get("model", ""))
    if info.get("quantization", "none") != "none" or "--quantization=" in args:
        return info.get("quantization") or args.split("--quantization=")[1].split()[0]
    if info.get("dtype"):
        return info["dtype"]
    return next((d for d in ("float32", "bfloat16") if f"--dtype={d}" in args), "?")


def _pair_of_peer(p: dict) -> str:
    if p.get("pair"):
        return p["pair"]
    precision = p.get("precision", "")
    return "float32" if precision in ("float32", "GGUF F32") else precision.split(" (")[0]


def _fmt(x: float | None, digits: int) -> str:
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def render(engine: dict | None, https: list[dict], peers: dict | None) -> str:
    # rows: (pair, sort key, concurrency cell, rank, server, precision, tok/s, ttft p50, itl p50, itl p99)
    rows, notes = [], []
    pp_cell = f"pp {(peers or {}).get('pp_len') or ''}".strip()

    def add(pair, n, rank, server, precision, tok_s, s=None, ttft=None):
        pp = n == "pp"
        rows.append(
            (
                pair,
                float("inf") if pp else int(n),
                pp_cell if pp else str(n),
                rank,
                server,
                precision,
                tok_s,
                s["ttft_p50_ms"] if s else ttft,
                s["itl_p50_ms"] if s else None,
                s["itl_p99_ms"] if s else None,
            )
        )

    if engine:
        notes.append(
            f"engine (in-process, no HTTP, no streaming: output tok/s only): {engine['prompt_len']}-token "
            f"prompts, {engine['gen_len']} new tokens per request"
        )
        for r in engine["rows"]:
            attention, linear = r.get("attention", "auto"), r.get("linear", "auto")
            precision = (
                r["mode"]
                + ("" if attention == "auto" else f", {attention} attention")
                + ("" if linear == "auto" else f", {linear} linear")
            )
            pair = "GGUF Q4_1" if r["mode"] == "gguf" else r["mode"]  # bench.engine serves the bundled file
            add(pair, r["concurrency"], 0, "sightline engine, in-process", precision, r["out_tok_s"])
    http_pairs = {}
    for http in https:
        pair, info = _pair_of_http(http), http.get("engine_info") or {}
        precision = "+".join(v for k, v in sorted(info.items()) if v != "none") or "?"
        flags = " ".join(http.get("server_args") or [])
        if pair in GGUF_PAIRS:
            flags = " ".join([Path(http.get("model", "")).name, flags]).strip()
        label = HTTP + (f" ({flags})" if flags else "")
        http_pairs.setdefault(pair, label)
        notes.append(f"{label}: {http['prompt_len']}-token prompts, {http['gen_len']} new tokens per request")
        for n, level in http["levels"].items():
            if "http" in level:
                add(pair, n, 1, label, precision, level["http"]["tok_s"], summary(level["http"]))
    if peers is None:
        notes.append("peers: no peers.json (run `python -m bench.peers`); no peer rows")
    else:
        notes.append(
            f"peers: {peers['prompt_len']}-token prompts, {peers['gen_len']} new tokens per request"
            + (f", {peers.get('cpus')} CPUs" if peers.get("cpus") else "")
        )
        for pair, r in (peers.get("sightline_pp") or {}).items():
            flags = ([Path(r["model"]).name] if r.get("model") else []) + (r.get("server_args") or [])
            label = http_pairs.get(pair, HTTP + f" ({' '.join(flags)})")
            if "skipped" in r:
                notes.append(f"{label}: pp skipped: {r['skipped']}")
            else:
                precision = {"float32": "float32", "int8": "bfloat16+int8"}.get(pair, pair)
                add(pair, "pp", 1, label, precision, r["tok_s"], ttft=r["ttft_p50_ms"])
        commands = []
        for i, (name, p) in enumerate(peers["peers"].items()):
            if "skipped" in p:
                notes.append(f"{name}: skipped: {p['skipped']}")
                continue
            pair = _pair_of_peer(p)
            for n, level in p["levels"].items():
                add(pair, n, 2 + i, p["label"], p["precision"], level["tok_s"], summary(level))
            if p.get("pp"):
                add(pair, "pp", 2 + i, p["label"], p["precision"], p["pp"]["tok_s"], ttft=p["pp"]["ttft_p50_ms"])
            for note in p.get("notes", []):
                notes.append(f"{name}: {note}")
            if p.get("command") and p["label"] == "llama-server" and not commands:
                commands.append(" ".join(Path(x).name if "/" in x else x for x in p["command"].split()))
        if peers.get("pp_len"):
            notes.append(
                f"pp rows: one {peers['pp_len']}-token prompt at a time, max_tokens 1, each server warmed "
                f"up: output tok/s column = prompt tokens ÷ TTFT p50 (of {len(_any_pp(peers)) or '?'} "
                "prompts new to the server)"
            )
        notes += [f"llama-server command: {c}" for c in commands]
    pairs_seen = {r[0] for r in rows}
    for pair in sorted(pairs_seen - set(http_pairs), key=_pair_key):
        if any(r[3] >= 2 for r in rows if r[0] == pair):
            notes.append(f"{pair}: no sightline HTTP run of this precision among the http*.json files")
    base: dict = {}
    for r in rows:
        if r[3] == 1:
            base.setdefault((r[0], r[2]), r[6])  # the first http*.json of a pair is what the others are divided by
    lines = [HEAD]
    for r in sorted(rows, key=lambda r: (_pair_key(r[0]), r[1], r[3])):
        ref = base.get((r[0], r[2]))
        ratio = f"{r[6] / ref:.2f}×" if ref else "–"
        lines.append(
            f"| {r[0]} | {r[2]} | {r[4]} | {r[5]} | {r[6]:.1f} | {ratio} | {_fmt(r[7], 0)} | "
            f"{_fmt(r[8], 1)} | {_fmt(r[9], 1)} |"
        )
    return "\n".join(lines + [""] + notes)


# bits per weight a decode step reads, by the precision column of a row (GGUF types: llama.cpp's nominal sizes)
BITS = {
    "float32": 32.0,
    "GGUF F32": 32.0,
    "bfloat16": 16.0,
    "bfloat16+int8": 8.0,
    "GGUF Q8_0": 8.5,
    "GGUF Q4_K_M": 4.85,
    "GGUF Q4_1": 5.0,
}
PAIR_BITS = {"GGUF Q8_0": 8.5, "GGUF Q4_K_M": 4.85, "GGUF Q4_1": 5.0}  # our rows of a GGUF pair read the file's bits


def roofline(kernels: dict | None, table: str) -> list[str]:
    """Each server's fraction of the machine's roofline (bench.kernels): at c=1 the weight bytes it
    streams per second (tok/s × weights × bits per weight) over the measured memory bandwidth, at
    c=64 its FLOP/s (tok/s × 2 × weights) over the fp32 matmul peak."""
    if not kernels or not kernels.get("linear_params"):
        return ["roofline: no kernels.json with linear_params (run `python -m bench.kernels --json ...`)"]
    roof, params = kernels["roofline"], kernels["linear_params"]
    out = [
        f"roofline ({kernels['cpu']}, {kernels['threads']} threads): memory {roof['bandwidth_gbs']:.1f} GB/s, "
        f"fp32 matmul peak {roof['gemm_gflops']:.0f} GFLOP/s; {params / 1e6:.1f} M weights per token"
    ]
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 5 or cells[1] not in ("1", "64") or cells[2].startswith("sightline engine"):
            continue
        tok_s = float(cells[4])
        bits = BITS.get(cells[3].split(" (")[0]) or PAIR_BITS.get(cells[0])
        if cells[1] == "1" and bits:
            gbs = tok_s * params * bits / 8 / 1e9
            out.append(
                f"  c=1 {cells[2]} ({cells[3]}): {gbs:.1f} GB/s of weights, "
                f"{100 * gbs / roof['bandwidth_gbs']:.0f} % of the bandwidth"
            )
        elif cells[1] == "64":
            gflops = tok_s * 2 * params / 1e9
            out.append(
                f"  c=64 {cells[2]} ({cells[3]}): {gflops:.1f} GFLOP/s, "
                f"{100 * gflops / roof['gemm_gflops']:.1f} % of the fp32 peak"
            )
    return out


def _any_pp(peers: dict) -> list:
    for r in [*(peers.get("sightline_pp") or {}).values(), *(p.get("pp") or {} for p in peers["peers"].values())]:
        if r.get("ttft"):
            return r["ttft"]
    return []


def _pair_key(pair: str) -> tuple[int, str]:
    return (PAIR_ORDER.index(pair) if pair in PAIR_ORDER else len(PAIR_ORDER), pair)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("results/bench"))
    ap.add_argument("--peers", type=Path, default=None, help="bench.peers' JSON (default: DIR/peers.json)")
    a = ap.parse_args(argv)

    def load(path: Path) -> dict | None:
        return json.loads(path.read_text()) if path.is_file() else None

    https = [json.loads(p.read_text()) for p in sorted(a.dir.glob("http*.json"))]
    table = render(load(a.dir / "engine.json"), https, load(a.peers or a.dir / "peers.json"))
    print(table)
    print("\n".join(roofline(load(a.dir / "kernels.json"), table)))
    for name, lines in (
        ("embeddings", embedding_lines),
        ("speculative", speculative_lines),
        ("speculative_peers", speculative_peers_lines),
    ):
        doc = load(a.dir / f"{name}.json")
        print("\n".join(lines(doc) if doc else [f"{name}: no {name}.json (run `python -m bench.{name} --json ...`)"]))


if __name__ == "__main__":
    main()
