"""Embeddings in the engine: which pooling a model serves, and pooling over prefill chunks.

An embedding request is a prefill-only request (`Req.pooling` set): it is admitted,
chunked and batched with generation like any prompt (the same step budget, so it never
starves decoding requests), generates no token, and finishes as soon as its last prompt
chunk has run, with its pooled hidden state (the final norm's output, float32) as result.
An encoder's (BERT's) input is one chunk, run whole in one step (`BatchBuilder.admit`).

Pooling (`--pooling`, or the model's sentence-transformers `1_Pooling/config.json`):
  last  the hidden state of the last token (Qwen3-Embedding, e5-mistral): a prefix the
        prefix cache holds is reused, only the rest of the prompt is computed;
  mean  the mean over every prompt token;
  cls   the first token's hidden state.
mean and cls read the hidden states of every (or the first) position, which the prefix
cache does not keep: those requests compute their whole prompt (they still fill the cache).
L2 normalisation and `dimensions` truncation are applied by the front end
(`serving.frontend.embeddings`), so one engine result serves either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.model_files import ModelLoadError

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' pooling config flags → our mode
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    """What a server's model serves as embeddings (None in its place: generation only)."""

    mode: str  # last | mean | cls
    normalize: bool  # the model's default: L2-normalise (sentence-transformers' Normalize module)
    embedding_only: bool  # an embedding model: generation routes are refused
    source: str  # where the mode came from: flag | sentence-transformers


def sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(mode, normalize) from a sentence-transformers directory (`modules.json` naming a Pooling module whose
    config sets one supported mode); None for a plain model.  Raises ValueError for an unsupported pooling."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return None
    cfg = json.loads((path / pooling.get("path", "1_Pooling") / "config.json").read_text())
    modes = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES]
    if len(modes) != 1 or others:
        raise ValueError(
            f"sentence-transformers pooling {sorted(k for k, v in cfg.items() if v is True)} is not "
            f"supported: exactly one of {', '.join(_ST_MODES)}"
        )
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    return modes[0], normalize


def max_seq_length(path: Path) -> int | None:
    """sentence-transformers' `sentence_bert_config.json` max_seq_length (all-MiniLM-L6-v2: 256 of its 512
    positions), the longest input it embeds; None when the directory has none."""
    try:
        found = json.loads((path / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, int) and found > 0 else None


def pooling_config(path: Path, flag: str | None, encoder: bool = False) -> PoolingConfig | None:
    """The server's pooling: the model's own (an embedding model) with `--pooling` overriding its mode, or
    `--pooling` on a generative model (which then serves both), or None (generation only).  An encoder
    (BERT) is an embedding model whatever its directory: it needs one or the other, else ModelLoadError."""
    try:
        found = sentence_transformers_pooling(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if found is not None:
        mode, normalize = found
        return PoolingConfig(flag or mode, normalize, True, "flag" if flag else "sentence-transformers")
    if flag:
        return PoolingConfig(flag, True, encoder, "flag")
    if encoder:
        raise ModelLoadError(
            f"{path}: an encoder model serves embeddings only: give --pooling mean|cls|last, or "
            "serve a sentence-transformers directory (modules.json, 1_Pooling/config.json)"
        )
    return None


def pool_rows(mode: str, offset: int, start: int, n: int, completes: bool) -> range:
    """Rows of the step's flat hidden states that pooling reads for one prefill chunk of a request
    (positions [start, start+n), at flat rows [offset, offset+n))."""
    if mode == "mean":
        return range(offset, offset + n)
    if mode == "cls":
        return range(offset, offset + 1) if start == 0 else range(0)
    return range(offset + n - 1, offset + n) if completes else range(0)


class PoolState:
    """One embedding request's running pooled value across its prefill chunks."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.acc: torch.Tensor | None = None
        self.count = 0

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """`hidden`: the rows `pool_rows` chose for one chunk starting at position `start`."""
        if start == 0:  # a first chunk (or a resumed request recomputing from position 0): start over
            self.acc, self.count = None, 0
        if self.mode == "mean":
            s = hidden.sum(dim=0)
            self.acc = s if self.acc is None else self.acc + s
            self.count += hidden.shape[0]
        else:
            self.acc, self.count = hidden[-1].clone(), 1

    def result(self) -> torch.Tensor:
        assert self.acc is not None, "pooled before any chunk"
        return self.acc / self.count if self.mode == "mean" else self.acc


def l2_normalize(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp(min=1e-12)
