"""What several benchmarks share: prompts that share nothing, the streaming client and its
workload (`run_levels`), a level's numbers and table row, the server's CPU seconds, a quiet
local server and the JSON file a run writes.  No torch: a prompt needs only a tokenizer."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import httpx

from loadtest.server import LocalServer
from telemetry.clock import now_ns


class HasTokenizer(Protocol):
    """A loaded model, or anything with its `.tokenizer` (all `make_prompts` uses)."""

    tokenizer: Any


TEXT = (
    "Sightline serves language models behind an HTTP streaming API. Every request is tokenized, "
    "scheduled into a continuous batch, decoded token by token and streamed back, while metrics "
    "and traces record where the time went. "
)


def openers(tokenizer, n: int, skip: int = 0) -> list[str]:
    """Words whose `f"{word}. {TEXT}"` encodings begin with n + skip different tokens (the last n
    returned): ASCII words of the vocabulary, in id order, the same for the same tokenizer."""
    words, firsts = [], set()
    for tid in range(1000, len(tokenizer)):
        word = tokenizer.decode([tid]).strip()
        if not (word.isascii() and word.isalpha() and len(word) >= 4):
            continue
        first = tokenizer(f"{word}. ")["input_ids"][0]
        if first not in firsts:
            firsts.add(first)
            words.append(word)
            if len(words) == skip + n:
                return words[skip:]
    raise ValueError(f"the vocabulary has fewer than {skip + n} usable words")


def make_prompts(model: HasTokenizer, n: int, length: int, start: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` tokens, no two beginning with the same token: a prefix cache
    finds nothing to share between them (prompts `start` … `start + n - 1` of one sequence, so
    disjoint ranges share nothing either).  Each is one encoding of one text, so it decodes and
    re-encodes to the same ids."""
    text = TEXT * (length // 20 + 4)
    return [model.tokenizer(f"{word}. {text}")["input_ids"][:length] for word in openers(model.tokenizer, n, start)]


# EOS is ignored so every request generates exactly max_tokens; each server has its own field for
# that (bench.peers passes theirs), the rest of the body is the same for every server.
SIGHTLINE_IGNORE_EOS = {"ignore_eos": True}


def completion_body(prompt: list[int] | str, gen_len: int, model: str | None = None, extra: dict | None = None) -> dict:
    """A streaming greedy `/v1/completions` request for exactly `gen_len` tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": gen_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    return {**body, **(SIGHTLINE_IGNORE_EOS if extra is None else extra)}


def _chunk_text(chunk: dict) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])


async def http_one(
    client: httpx.AsyncClient, ids: list[int] | str, gen_len: int, model: str | None = None, extra: dict | None = None
) -> tuple[float, int, list[float], bool]:
    """(TTFT ms, output tokens, inter-token gaps ms, whether the server reported usage).

    A token arrives with each SSE chunk that carries text; TTFT is request sent to the first
    such chunk.  Output tokens are the server's `usage.completion_tokens`, or, from a server
    that reports no usage while streaming, the number of text chunks."""
    t0 = now_ns()
    ttft, tokens, arrivals = None, None, []
    async with client.stream("POST", "/v1/completions", json=completion_body(ids, gen_len, model, extra)) as r:
        if r.is_error:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
            if _chunk_text(chunk):
                arrivals.append(now_ns())
                if ttft is None:
                    ttft = (arrivals[-1] - t0) / 1e6
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if ttft is None:
        raise RuntimeError("the stream ended without any text")
    itl = [(b - a) / 1e6 for a, b in zip(arrivals, arrivals[1:])]
    return ttft, len(arrivals) if tokens is None else tokens, itl, tokens is not None


async def http_run(
    url: str, prompts: list[list[int]] | list[str], gen_len: int, model: str | None = None, extra: dict | None = None
) -> dict:
    """All `prompts` at once; output tok/s = all output tokens ÷ wall time."""
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(http_one(client, p, gen_len, model, extra) for p in prompts))
        wall = time.perf_counter() - t0
    return {
        "ttft": [r[0] for r in res],
        "tok_s": sum(r[1] for r in res) / wall,
        "wall": wall,
        "itl": [g for r in res for g in r[2]],
        "tokens": sum(r[1] for r in res),
        "tokens_from": "usage" if all(r[3] for r in res) else "text chunks",
    }


def level_prompts(model, levels: list[int], prompt_len: int) -> dict[int, list[list[int]]]:
    """Each level's prompts (`model` needs only `.tokenizer`), disjoint from every other level's:
    no server (our prefix cache, llama.cpp's reuse of its previous sequence) meets a prompt it
    has computed before, so every level pays its whole prefill."""
    out, start = {}, 0
    for n in levels:
        out[n], start = make_prompts(model, n, prompt_len, start=start), start + n
    return out


def run_levels(
    url: str,
    prompts: dict[int, list],
    gen_len: int,
    model: str | None = None,
    extra: dict | None = None,
    cpu_probe: Callable[[], dict[str, float]] | None = None,
) -> dict[int, dict]:
    """The HTTP benchmarks' workload against any OpenAI-compatible server at `url`: a 2-request warm-up,
    then for each concurrency N (the keys of `prompts`) its N prompts all at once.  The warm-up
    sends the first prompts reversed, so that no server (prefix cache, llama.cpp's reuse of the
    previous sequence) starts a level with its prompt already computed.  With `cpu_probe` (our
    /metrics), also CPU seconds per 1,000 output tokens per process."""
    first = next(iter(prompts.values()))
    asyncio.run(http_run(url, [p[::-1] for p in first[:2]], 4, model, extra))  # warm-up
    rows = {}
    for n, ps in prompts.items():
        before = cpu_probe() if cpu_probe else None
        rows[n] = r = asyncio.run(http_run(url, ps, gen_len, model, extra))
        if cpu_probe:
            after = cpu_probe()
            r["cpu_per_1k"] = {role: 1000 * (after[role] - before.get(role, 0.0)) / r["tokens"] for role in after}
    return rows


def summary(r: dict) -> dict:
    """The table's numbers from one level's raw result (engine or HTTP)."""
    return {
        "ttft_p50_ms": statistics.median(r["ttft"]),
        "ttft_max_ms": max(r["ttft"]),
        "itl_p50_ms": pct(r.get("itl", []), 0.5),
        "itl_p99_ms": pct(r.get("itl", []), 0.99),
        "tok_s": r["tok_s"],
        "wall_s": r["wall"],
    }


TABLE_HEAD = (
    "| concurrency | path | TTFT p50 ms | TTFT max ms | ITL p50 ms | ITL p99 ms | output tok/s | wall s |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|"
)


def table_row(n: int, path: str, r: dict) -> str:
    s = summary(r)
    return (
        f"| {n} | {path} | {s['ttft_p50_ms']:.0f} | {s['ttft_max_ms']:.0f} | {s['itl_p50_ms']:.1f} | "
        f"{s['itl_p99_ms']:.1f} | {s['tok_s']:.1f} | {s['wall_s']:.1f} |"
    )


def metric_samples(url: str, name: str) -> list:
    """The samples named `name` the server at `url` exports on /metrics now."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def cpu_seconds(url: str) -> dict[str, float]:
    """CPU seconds so far of each server process (main, scheduler, detokenizer), from /metrics."""
    return {s.labels["role"]: s.value for s in metric_samples(url, "sightline_process_cpu_seconds_total")}


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def start_server(model: str, port: int, log: Path, flags: list[str]) -> LocalServer:
    """A local server at `--log-level warning` plus `flags`, healthy on return."""
    return LocalServer(model, port, log, ["--log-level", "warning", *flags])


def engine_bench_args(description: str, gen_len: int) -> argparse.ArgumentParser:
    """The options every in-process engine bench takes (model, concurrency levels, lengths, rounds, --json)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=gen_len)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def in_process_engine(a: argparse.Namespace, threads: int | None = None) -> tuple[Any, Any, list[int], list[list[int]]]:
    """(loaded model, float32 SchedulerCore with `threads` compute threads (None: the server's default),
    concurrency levels, prompts for the largest) from `engine_bench_args`' options; imported here, after the
    bench has set its thread environment."""
    from serving.args import ServerArgs
    from serving.engine.loader import load_model
    from serving.engine.scheduler_core import SchedulerCore

    loaded = load_model(a.model)
    core = SchedulerCore(loaded, ServerArgs(model=a.model, dtype="float32", num_threads=threads))
    levels = [int(c) for c in a.concurrency.split(",")]
    return loaded, core, levels, make_prompts(loaded, max(levels), a.prompt_len)


def write_json(path: Path, doc: dict) -> None:
    """`doc` as indented JSON at `path`, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
