"""Resident memory of a real server on a GGUF file: every process, the Scheduler's share, the goal.

    .venv/bin/python -m bench.memory [--model smollm2-135m] [--max-total-tokens 4096]
                                     [--quantization auto,none] [--json results/bench/memory.json]

Per `--quantization` mode: a server is started on the model, `--concurrency` completions of
`--gen-len` tokens run at once (every weight and the KV pool are touched), then each process's
VmRSS (and its anonymous / file-backed split) is read from /proc.  The Scheduler's own cost is
its RSS minus a baseline: a fresh interpreter that imports what the Scheduler imports and reads
the model's config (python, torch, transformers, numpy — code every model-running process
carries).  Beside it: the GGUF file's size and the KV pool's bytes (slots × layers × 2 × KV heads
× head dim × dtype size); the goal is Scheduler − baseline ≤ 1.5 × the file + the KV pool.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import start_server, write_json
from loadtest.server import free_port
from serving.model_files import bundled_gguf_path, prepare_model_dir

BASELINE = """
import json, sys
import serving.engine.scheduler  # noqa: F401  (what the Scheduler process imports)
from transformers import AutoConfig
AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps(open('/proc/self/status').read()))
"""


def rss_mib(status: str) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of a /proc/<pid>/status text, in MiB."""
    out = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def baseline_mib(model_dir: Path) -> float:
    res = subprocess.run(
        [sys.executable, "-c", BASELINE, str(model_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return rss_mib(json.loads(res.stdout.strip().splitlines()[-1]))["VmRSS"]


def kv_pool_mib(model_dir: Path, slots: int, dtype_bytes: int) -> float:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return (slots + 1) * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes / 2**20  # +1: the pad slot


def measure(model: str, mode: str, a: argparse.Namespace) -> dict:
    flags = ["--max-total-tokens", str(a.max_total_tokens), "--quantization", mode]
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(model, free_port(), Path(tmp) / "server.log", flags)
        try:
            body = {
                "prompt": "The lighthouse keeper climbed the stairs every evening, and at the top he lit",
                "max_tokens": a.gen_len,
                "temperature": 0,
                "ignore_eos": True,
            }
            with ThreadPoolExecutor(a.concurrency) as pool:
                codes = list(
                    pool.map(
                        lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=600).status_code,
                        range(a.concurrency),
                    )
                )
            assert codes == [200] * a.concurrency, codes
            card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
            pids = httpx.get(server.url + "/debug/state", timeout=10).json()["pids"]
            procs = {"main": rss_mib(Path(f"/proc/{server.proc.pid}/status").read_text())}
            for role, pid in pids.items():
                procs[role] = rss_mib(Path(f"/proc/{pid}/status").read_text())
        finally:
            server.stop()
    return {"mode": mode, "quantization": card.get("quantization"), "dtype": card.get("dtype"), "processes": procs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--quantization", default="auto,none")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    model_dir, _ = prepare_model_dir(a.model)
    gguf = bundled_gguf_path() if a.model == "smollm2-135m" else Path(a.model)
    file_mib = gguf.stat().st_size / 2**20 if gguf.suffix == ".gguf" else None
    base = baseline_mib(model_dir)
    runs = [measure(a.model, mode, a) for mode in a.quantization.split(",")]
    print(
        f"model {a.model} ({f'{file_mib:.1f} MiB GGUF' if file_mib else 'no GGUF'}), --max-total-tokens "
        f"{a.max_total_tokens}, {a.concurrency} × {a.gen_len} tokens, {os.cpu_count()} CPUs; baseline process "
        f"(imports + config) {base:.0f} MiB\n"
    )
    print(
        "| mode (served as) | main MiB | detokenizer MiB | scheduler MiB (anon / file) | scheduler − baseline "
        "| KV pool MiB | rest | rest ÷ file | goal ≤ 1.5 × file + KV |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        p, s = r["processes"], r["processes"]["scheduler"]
        kv = kv_pool_mib(model_dir, a.max_total_tokens, 2 if r["dtype"] == "bfloat16" else 4)
        own = s["VmRSS"] - base
        r.update(baseline_mib=base, kv_pool_mib=kv, scheduler_own_mib=own, file_mib=file_mib)
        rest = own - kv
        verdict = "–" if not file_mib else ("met" if own <= 1.5 * file_mib + kv else "not met")
        print(
            f"| {r['mode']} ({r['quantization']}, {r['dtype']}) | {p['main']['VmRSS']:.0f} | "
            f"{p['detokenizer']['VmRSS']:.0f} | {s['VmRSS']:.0f} ({s['RssAnon']:.0f} / {s['RssFile']:.0f}) | "
            f"{own:.0f} | {kv:.0f} | {rest:.0f} | {f'{rest / file_mib:.2f}×' if file_mib else '–'} | {verdict} |"
        )
    if a.json:
        write_json(a.json, {"model": a.model, "max_total_tokens": a.max_total_tokens, "runs": runs})


if __name__ == "__main__":
    main()
