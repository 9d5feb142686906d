"""Perplexity of each GGUF file as sightline serves it and as llama.cpp's own `llama-perplexity`
scores it: the same file, the same text, the same chunks, the same scored tokens.

    .venv/bin/python -m bench.perplexity [--types F32,Q8_0,Q4_K_M,Q4_1] [--ctx 256] [--chunks 12]

The text is this repository's docs (docs/*.md, sorted, joined with blank lines).  Both sides do
what llama-perplexity does: tokenize the whole text (a BOS first where the file says add_bos),
cut it into chunks of `--ctx` tokens (the first token of each replaced by BOS where add_bos), run
each chunk as one prompt, and score the second half of it (token j+1 from the logits at j, for j
in [ctx/2, ctx-1)).  Ours runs the engine in-process on the file in its own types (`gguf`; the
F32 file on the float32 kernel); llama-perplexity is built by bench.peers (`llama-perplexity`
target).  Both print the chunks they scored; llama.cpp tokenizes the text itself, so the F32
file's two numbers agreeing is what says the tokens are the same.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.accuracy import all_logits, runner_for
from bench.peers import GGUF_TYPES, REPO, Skip, ensure_gguf, ensure_llama_server, gguf_path
from serving.engine.loader import load_model
from serving.models.gguf_index import GGUFIndex


def corpus() -> str:
    return "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))


def chunks(tokens: list[int], ctx: int, n: int, bos: int | None) -> list[list[int]]:
    out = []
    for i in range(min(n, len(tokens) // ctx)):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        out.append([bos, *chunk[1:]] if bos is not None else chunk)
    return out


def ours(path: Path, text: str, ctx: int, n: int) -> tuple[float, int]:
    """(perplexity, chunks scored) of our engine on the file, scored as llama-perplexity scores."""
    model = load_model(str(path))
    fields = GGUFIndex(path).fields
    bos = model.tokenizer.bos_token_id if fields.get("tokenizer.ggml.add_bos_token") else None
    tokens = ([bos] if bos is not None else []) + model.tokenizer(text, add_special_tokens=False)["input_ids"]
    runner = runner_for(model, "float32", "gguf")
    nll, count, first = 0.0, 0, ctx // 2
    parts = chunks(tokens, ctx, n, bos)
    for chunk in parts:
        logp = torch.log_softmax(all_logits(runner, chunk)[first : ctx - 1].double(), dim=-1)
        nll -= logp.gather(1, torch.tensor(chunk[first + 1 : ctx])[:, None]).sum().item()
        count += ctx - 1 - first
    return math.exp(nll / count), len(parts)


def llama(bindir: Path, path: Path, text_file: Path, ctx: int, n: int) -> tuple[float, int]:
    """(perplexity, chunks scored) from llama-perplexity's own output."""
    res = subprocess.run(
        [
            str(bindir / "llama-perplexity"),
            "-m",
            str(path),
            "-f",
            str(text_file),
            "-c",
            str(ctx),
            "--chunks",
            str(n),
            "-b",
            str(ctx),
            "-t",
            str(max(1, len(_cores()))),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = res.stdout + res.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    scored = re.search(r"calculating perplexity over (\d+) chunks", out)
    if res.returncode != 0 or final is None or scored is None:
        raise RuntimeError(f"llama-perplexity failed ({res.returncode}): {out[-1500:]}")
    return float(final.group(1)), int(scored.group(1))


def _cores() -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(GGUF_TYPES))
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=12)
    a = ap.parse_args(argv)
    text = corpus()
    try:
        bindir, _ = ensure_llama_server()
    except Skip as exc:
        bindir = None
        print(f"llama-perplexity: skipped: {exc}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "docs.txt"
        text_file.write_text(text)
        for t in a.types.split(","):
            path = gguf_path(t) if t == "Q4_1" or bindir is None else ensure_gguf(t, bindir)[0]
            if not path.is_file():
                print(f"{t}: no GGUF file here ({path})")
                continue
            ppl, n_tok = ours(path, text, a.ctx, a.chunks)
            ref, ref_tok = llama(bindir, path, text_file, a.ctx, a.chunks) if bindir else (float("nan"), -1)
            rows.append((t, ppl, ref, n_tok, ref_tok))
            print(
                f"{t}: sightline {ppl:.4f} ({n_tok} chunks), llama-perplexity {ref:.4f} ({ref_tok} chunks)", flush=True
            )
    f32 = next((r[1] for r in rows if r[0] == "F32"), None)
    print(f"\n{a.chunks} chunks of {a.ctx} tokens of docs/*.md, the second half of each scored\n")
    print("| file | sightline PPL | llama-perplexity PPL | sightline ÷ llama.cpp | sightline ÷ F32 (ours) |")
    print("|---|---:|---:|---:|---:|")
    for t, ppl, ref, *_ in rows:
        vs_f32 = f"{100 * (ppl / f32 - 1):+.2f} %" if f32 else "–"
        print(f"| {t} | {ppl:.4f} | {ref:.4f} | {100 * (ppl / ref - 1):+.2f} % | {vs_f32} |")


if __name__ == "__main__":
    main()
