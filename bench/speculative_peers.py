"""Prompt-lookup speculation beside llama.cpp's own: one stream, over HTTP, on bench.speculative's prompts.

    .venv/bin/python -m bench.speculative_peers [--gen-len 128] [--rounds 3] [--json FILE]

Arms, each a server of its own, started alone, used, stopped (only one runs at a time), in an order that
reverses every round, over `--rounds` rounds:

* sightline float32 on the bundled model (as bench.http serves it), without and with `--speculative ngram`;
* llama-server (bench.peers builds it) on the F32 GGUF of the same weights, one slot, `--metrics`, without
  speculation and with each n-gram type its `--spec-type` offers (ngram-simple, ngram-map-k, ngram-map-k4v,
  ngram-mod, ngram-cache) at its defaults, plus the three that take n-gram sizes with sizes near ours (a
  4-token key, 8-token drafts): their defaults are sized for long outputs (12- to 24-token keys, 48 to 64
  drafted).

Both servers get the same compute threads (`--num-threads` / `-t -tb`): the cores this process may run on
(taskset), not the machine's.  The client runs there too.  Each workload (bench.speculative.WORKLOADS: two
copy-heavy chat prompts, one free text) is sent chat-templated, as token ids, to `/v1/completions`, streaming,
greedy, until EOS or `--gen-len` tokens.  Decode tok/s = (output tokens − 1) ÷ (last token's arrival − first
token's): TTFT is left out (prefill is not what speculation changes).  Acceptance is the accepted ÷ proposed
draft tokens from each server's /metrics around the arm's requests.  The table gives each arm's median decode
tok/s with its spread (min–max over rounds), the speedup over its own server's non-speculative arm, and per
workload sightline-with-speculation ÷ llama.cpp's best arm (whichever of its settings was fastest on that
workload).  The goal: copy-heavy ≥ 1.5× its own off and ahead of llama.cpp's best; free text within
3 % of off.  A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import http_run, start_server, write_json
from bench.peers import (
    LLAMA_DIR,
    Peer,
    PeerServer,
    Skip,
    llama_server_command,
    our_run,
    prepare_llama_server,
)
from bench.speculative import WORKLOADS, chat_ids, speculative_peers_lines

SHORT = ("4", "8")  # key and draft lengths near ours (--speculative-ngram-max 4, --speculative-num-tokens 5)
LLAMA_SPEC: dict[str, list[str]] = {  # arm name → llama-server's flags
    "none": [],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple n4 m8": [
        *("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", SHORT[0]),
        *("--spec-ngram-simple-size-m", SHORT[1]),
    ],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-map-k n4 m8": [
        *("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", SHORT[0]),
        *("--spec-ngram-map-k-size-m", SHORT[1]),
    ],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-mod n4 m8": [
        *("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", SHORT[0]),
        *("--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", SHORT[1]),
    ],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}
# The draft counters of each server's /metrics: (proposed, accepted), summed over their labels.
COUNTERS = {
    "sightline": ("sightline_speculative_proposed_tokens_total", "sightline_speculative_accepted_tokens_total"),
    "llama-server": ("llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total"),
}
SEQ_TOKENS = 2048  # llama-server's context for its one slot: every workload's prompt and output fit


@dataclass
class Arm:
    """One server setting, and what its rounds measured."""

    server: str  # "sightline" or "llama-server"
    setting: str  # "off", "ngram", or a LLAMA_SPEC key
    flags: list[str]
    rates: dict[str, list[float]] = field(default_factory=dict)  # workload → decode tok/s per round
    ttft: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    drafts: dict[str, list[float]] = field(default_factory=dict)  # workload → [proposed, accepted]

    @property
    def name(self) -> str:
        return f"{self.server} {self.setting}"

    @property
    def speculates(self) -> bool:
        return self.setting not in ("off", "none")


def draft_counters(url: str, server: str) -> tuple[float, float]:
    """(proposed, accepted) draft tokens so far, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    names = COUNTERS[server]
    totals = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in totals:
                totals[s.name] += s.value
    return totals[names[0]], totals[names[1]]


def decode_rate(r: dict) -> float:
    """Output tokens after the first ÷ the seconds from the first token's arrival to the last's."""
    span = sum(r["itl"]) / 1000
    return (r["tokens"] - 1) / span if span > 0 else float("nan")


@dataclass
class Run:
    """What every arm's round shares."""

    prompts: dict[str, list[int]]  # workload → chat-templated token ids
    warmup: list[int]  # a prompt none of the workloads shares (llama-server's ngram-mod learns across requests)
    gen_len: int
    threads: int
    bindir: Path | None  # llama-server's binaries; None: no llama arms
    log_dir: Path


def start(arm: Arm, run: Run):
    """The arm's server, healthy: sightline as bench.http serves float32, or llama-server on the F32 GGUF."""
    from loadtest.server import free_port

    if arm.server == "sightline":
        model, flags = our_run("float32")
        return start_server(model, free_port(), run.log_dir / "sightline.log", [*flags, *arm.flags])
    peer = Peer(
        name=f"llama-server-F32 {arm.setting}",
        label="llama-server",
        precision="GGUF F32",
        pair="float32",
        requirement="",
        prepare=lambda: (run.bindir, None),
        command=lambda b, port, seq: [
            *llama_server_command(b, port, seq, "F32", threads=run.threads, slots=1),
            "--metrics",
            *arm.flags,
        ],
        ignore_eos=lambda n: {},
        health_path="/health",
        home=LLAMA_DIR,
        log_name="server-F32-speculative.log",
        retry_args=("--no-repack",),
    )
    return PeerServer(peer, run.bindir, SEQ_TOKENS)


def run_arm(arm: Arm, run: Run) -> None:
    """One round of one arm: its server started, warmed up, every workload once, stopped."""
    server = start(arm, run)
    try:
        asyncio.run(http_run(server.url, [run.warmup], 16, extra={}))
        for name, ids in run.prompts.items():
            before = draft_counters(server.url, arm.server)
            r = asyncio.run(http_run(server.url, [ids], run.gen_len, extra={}))
            after = draft_counters(server.url, arm.server)
            arm.rates.setdefault(name, []).append(decode_rate(r))
            arm.ttft.setdefault(name, []).append(r["ttft"][0])
            arm.tokens.setdefault(name, []).append(r["tokens"])
            d = arm.drafts.setdefault(name, [0.0, 0.0])
            d[0], d[1] = d[0] + after[0] - before[0], d[1] + after[1] - before[1]
    finally:
        server.stop()


def make_arms(threads: int, with_llama: bool) -> list[Arm]:
    ours = [f"--num-threads={threads}"]
    arms = [Arm("sightline", "off", ours), Arm("sightline", "ngram", [*ours, "--speculative=ngram"])]
    if with_llama:
        arms += [Arm("llama-server", name, flags) for name, flags in LLAMA_SPEC.items()]
    return arms


def summarise(arms: list[Arm]) -> dict:
    """Per workload and arm: medians, spreads, speedup over the server's own off arm, acceptance."""
    out: dict = {}
    for wl, (kind, _) in WORKLOADS.items():
        rows = {}
        for arm in arms:
            if wl not in arm.rates:
                continue
            proposed, accepted = arm.drafts[wl]
            rows[arm.name] = {
                "server": arm.server,
                "setting": arm.setting,
                "tok_s": statistics.median(arm.rates[wl]),
                "spread": [min(arm.rates[wl]), max(arm.rates[wl])],
                "ttft_ms": statistics.median(arm.ttft[wl]),
                "output_tokens": arm.tokens[wl],
                "proposed": proposed,
                "acceptance": accepted / proposed if proposed else None,
            }
        for row in rows.values():
            own = rows.get(f"{row['server']} {'off' if row['server'] == 'sightline' else 'none'}")
            row["speedup"] = row["tok_s"] / own["tok_s"] if own else None
        llama = {k: r for k, r in rows.items() if r["server"] == "llama-server"}
        best = max(llama, key=lambda k: llama[k]["tok_s"]) if llama else None
        on = rows.get("sightline ngram")
        out[wl] = {
            "kind": kind,
            "arms": rows,
            "llama_best": best,
            "sightline_over_llama_best": on["tok_s"] / llama[best]["tok_s"] if on and best else None,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    from serving.model_files import BUNDLED_MODEL, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-peers", action="store_true", help="sightline's arms only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)

    tok, _ = load_tokenizer(BUNDLED_MODEL)
    prompts = {name: chat_ids(tok, message) for name, (_, message) in WORKLOADS.items()}
    threads = len(os.sched_getaffinity(0))
    bindir, skipped = None, "--skip-peers" if a.skip_peers else None
    if not a.skip_peers:
        try:
            bindir, _ = prepare_llama_server("F32")
        except Skip as exc:
            skipped = str(exc)
            print(f"llama-server: skipped: {exc}", flush=True)
    arms = make_arms(threads, bindir is not None)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(prompts, chat_ids(tok, "Name three colours."), a.gen_len, threads, bindir, Path(tmp))
        for r in range(a.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                run_arm(arm, run)
                print(f"round {r + 1}: {arm.name}: {[round(x[-1], 1) for x in arm.rates.values()]} tok/s", flush=True)
    doc = {
        "model": BUNDLED_MODEL,
        "threads": threads,
        "gen_len": a.gen_len,
        "rounds": a.rounds,
        "seconds": round(time.monotonic() - t0, 1),
        "llama_skipped": skipped,
        "llama_command": " ".join(
            Path(x).name if "/" in x else x
            for x in llama_server_command(bindir, 0, SEQ_TOKENS, "F32", threads=threads, slots=1) + ["--metrics"]
        )
        if bindir
        else None,
        "workloads": summarise(arms),
    }
    if a.json:
        write_json(a.json, doc)
    print("\n".join(speculative_peers_lines(doc)))


if __name__ == "__main__":
    main()
