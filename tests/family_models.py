"""Small seeded models of every registered family, built from the real configs in
tests/fixtures/families/ with the dimensions shrunk, saved as Hugging Face directories.

The families' own tokenizers are not reachable offline: every model uses the bundled
SmolLM2 tokenizer (and so its ChatML chat template).  Built once per cache directory and
reused; the directory name carries the seed and a hash of the config.  `build(family, vocab=n)`
is the same model with its vocabulary cut to the tokenizer's first n tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from serving.model_files import BUNDLED_MODEL, default_cache_dir, prepare_model_dir

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "families"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SEED = 4321
SHRINK = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# head_dim kept where the real config sets one that differs from hidden/heads (Qwen3's 128 vs 64):
# 64 keeps Llama-3's RoPE scaling with frequencies in its smoothed band.
HEAD_DIM = {"llama": 64, "qwen3": 48}
SLIDING_WINDOW = {"mistral": 16}  # shorter than the test prompts, so the window is exercised
# `build(family, vocab=CUT_VOCAB)`: for tests of a GGUF file's mechanics, where the 49k-token tokenizer
# and embedding would be most of each file's writing, parsing and conversion (~10 s a file)
CUT_VOCAB = 1024


def real_config(family: str) -> dict:
    return json.loads((CONFIGS / f"{family}.json").read_text())


def shrunk_config(family: str, tokenizer) -> dict:
    cfg = {**real_config(family), **SHRINK}
    if family in HEAD_DIM:
        cfg["head_dim"] = HEAD_DIM[family]
    if family in SLIDING_WINDOW:
        cfg["sliding_window"] = SLIDING_WINDOW[family]
    cfg.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.3,
        torch_dtype="float32",
    )  # peaked logits: no greedy ties
    return cfg


def _randomise(model: torch.nn.Module) -> None:
    """Norm weights and biases are 1 and 0 at init: make them random too, so they are exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower():  # RMSNorm weights, BERT's LayerNorm
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))


@functools.cache
def _bundled_tokenizer():
    """Loaded once a process: every `build` reads it for the config's hash (~0.5 s a load)."""
    from transformers import AutoTokenizer

    tok_dir, _ = prepare_model_dir(BUNDLED_MODEL)
    return AutoTokenizer.from_pretrained(tok_dir)


def cut_vocab(tokenizer_json: dict, n: int) -> dict:
    """A BPE tokenizer.json cut to the ids below `n`, with the merges among the kept tokens (SmolLM2's
    merge i makes token 252 + i: its first n - 252 merges), as `tests.gguf_writer` cuts a file's."""
    model = tokenizer_json["model"]
    vocab = {t: i for t, i in model["vocab"].items() if i < n}
    merges = [m for m in model["merges"] if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    return {
        **tokenizer_json,
        "model": {**model, "vocab": vocab, "merges": merges},
        "added_tokens": [t for t in tokenizer_json["added_tokens"] if t["id"] < n],
    }


def _derive(
    src: Path,
    out: Path,
    config: dict,
    edit: Callable[[dict[str, torch.Tensor]], None],
    tokenizer: Callable[[dict], dict] | None = None,
) -> None:
    """`src` copied to `out` with `config` merged into its config.json, its weights edited in place by `edit` and
    its tokenizer.json by `tokenizer` (written once: a concurrent builder's copy wins)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    cfg = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**cfg, **config}, indent=2))
    weights = load_file(tmp / "model.safetensors")
    edit(weights)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tok = tmp / "tokenizer.json"
        tok.write_text(json.dumps(tokenizer(json.loads(tok.read_text())), ensure_ascii=False))
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)


def _cut_model(src: Path, out: Path, n: int) -> None:
    """`src` with the embedding (and an untied lm_head) cut to its first `n` rows, and the tokenizer to match."""

    def cut(weights: dict[str, torch.Tensor]) -> None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] = weights[name][:n].contiguous()

    _derive(src, out, {"vocab_size": n}, cut, lambda tok: cut_vocab(tok, n))


def build(family: str, cache_dir: Path | None = None, vocab: int | None = None) -> Path:
    """The family's shrunk seeded model as an HF directory (safetensors + the bundled tokenizer);
    with `vocab` (CUT_VOCAB), the same layers with the tokenizer, embedding and lm_head cut to the
    first `vocab` tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if vocab is not None:
        src = build(family, cache_dir)
        out = src.with_name(f"{src.name}-v{vocab}")
        if not (out / "config.json").is_file():
            _cut_model(src, out, vocab)
        return out

    tok = _bundled_tokenizer()
    cfg = shrunk_config(family, tok)
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / "families" / f"{family}-s{SEED}-{digest}"
    if (out / "config.json").is_file():
        return out
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomise(model)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


# `draft_pair`: the target's last layer writes this fraction of its attention and MLP outputs, so the draft (the
# target without that layer) agrees with it often, as a real draft of the same family does
DRAFT_LAYER_SCALE = 0.05


def draft_pair(family: str = "llama", cache_dir: Path | None = None, vocab: int | None = None) -> tuple[Path, Path]:
    """A target and its draft for speculative decoding, same tokenizer: the family's model (`vocab` as `build`'s)
    with its last layer's outputs scaled by DRAFT_LAYER_SCALE, and that model without its last layer (fewer
    parameters)."""
    src = build(family, cache_dir, vocab)
    last = SHRINK["num_hidden_layers"] - 1
    target, draft = src.with_name(f"{src.name}-target"), src.with_name(f"{src.name}-draft")
    outputs = (f"model.layers.{last}.self_attn.o_proj.weight", f"model.layers.{last}.mlp.down_proj.weight")

    def scale(weights: dict[str, torch.Tensor]) -> None:
        for name in outputs:
            weights[name] = weights[name] * DRAFT_LAYER_SCALE

    def drop(weights: dict[str, torch.Tensor]) -> None:
        for name in [n for n in weights if n.startswith(f"model.layers.{last}.")]:
            del weights[name]

    if not (target / "config.json").is_file():
        _derive(src, target, {}, scale)
    if not (draft / "config.json").is_file():
        _derive(src, draft, {"num_hidden_layers": last}, drop)
    return target, draft


def gguf(family: str, cache_dir: Path | None = None, vocab: int | None = None) -> Path:
    """The family's model (`build`'s, `vocab` as there) as an F32 GGUF file written as llama.cpp writes
    one, beside its HF directory and written once: every test that serves it shares one conversion (~10 s)."""
    from tests.gguf_writer import write_gguf

    hf_dir = build(family, cache_dir, vocab)
    out = hf_dir.with_name(hf_dir.name + ".gguf")
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        write_gguf(hf_dir, tmp)
        tmp.rename(out)
    return out


def main() -> int:
    """`python -m tests.family_models`: build every family's model, its GGUF file and that file's
    conversion into the default cache (what `make setup` runs, so the tests find them ready)."""
    import time

    for family in FAMILIES:
        t0 = time.perf_counter()
        path, converted = prepare_model_dir(str(gguf(family)))
        print(f"{family}: {'converted' if converted else 'cached'} at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
