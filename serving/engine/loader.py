"""Load a model's weights for the engine (Scheduler process): a transformers model in fp32.

Where the model comes from (bundled GGUF, tiny-random, a local directory) and its
one-time conversion are `serving.model_files`; which architectures are served is the
model registry (`serving.models.registry`).

The transformers model is loaded only when something uses it (`LazyHFModel`): the engine builds
its forward from the GGUF file itself (`serving.models.gguf_weights`, `--quantization gguf`) or
from the directory's safetensors (`serving.models.safetensors_weights`), so a Scheduler never
imports transformers' model classes.  A directory without safetensors (.bin) is loaded eagerly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.model_files import (
    BUNDLED_MODEL,
    ModelLoadError,
    default_cache_dir,
    model_name,
    one_line,
    prepare_model_dir,
    quiet_transformers,
)

LOAD_REPORT = ("missing_keys", "unexpected_keys", "mismatched_keys")


@dataclass
class LoadedModel:
    name: str  # the name clients use in the `model` field
    hf_model: Any  # a transformers *ForCausalLM, fp32, eval mode
    path: Path  # the HF directory the weights were read from
    architecture: str  # the registered architecture served, e.g. LlamaForCausalLM
    load_seconds: float
    converted: bool  # True when this load had to convert (cold start)
    gguf: Path | None = None  # the GGUF file the weights came from, if any
    encoder: bool = False  # an encoder family (BERT): embeddings only, `hf_model` an AutoModel
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer, loaded on first use: the Scheduler never needs it (~45 MiB resident),
        the CLI, benchmarks and tests do; the processes that tokenize load their own."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer

    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id, read from its files without loading it (loaded only if they do not say)."""
        if self._tokenizer is None:
            found = special_token_id(self.path, "eos_token")
            if found is not None:
                return found
        return self.tokenizer.eos_token_id


def special_token_id(path: Path, key: str) -> int | None:
    """The id of tokenizer_config.json's `key` token (e.g. eos_token) from tokenizer.json, or None."""
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        tok = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    content = cfg.get(key)
    if isinstance(content, dict):
        content = content.get("content")
    if not isinstance(content, str):
        return None
    for added in tok.get("added_tokens") or ():
        if added.get("content") == content and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (tok.get("model") or {}).get("vocab")
    found = vocab.get(content) if isinstance(vocab, dict) else None
    return found if isinstance(found, int) else None


class LazyHFModel:
    """A GGUF file's converted transformers model, loaded on first use of anything but its configs.

    `config` and `generation_config` (what the engine reads of every model, `serving.models.resolved_config`)
    come without the weights; any other attribute, or a call, loads the model once and is forwarded to it.
    """

    def __init__(self, path: Path, config: Any, generation_config: Any, encoder: bool = False) -> None:
        self._path, self._model, self._encoder = path, None, encoder
        self.config, self.generation_config = config, generation_config

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> Any:
        if self._model is None:
            self._model = _load_weights(self._path, self._encoder)
        return self._model

    def __getattr__(self, name: str) -> Any:  # only for what __init__ did not set
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.load(), name)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.load()(*args, **kw)


def _gguf_source(path: Path) -> Path | None:
    """The GGUF file a converted directory was made from (its sightline.json says)."""
    marker = path / "sightline.json"
    source = json.loads(marker.read_text()).get("source") if marker.is_file() else None
    return Path(source) if isinstance(source, str) and source.endswith(".gguf") and Path(source).is_file() else None


def _load_weights(path: Path, encoder: bool = False) -> Any:
    """The transformers model: a *ForCausalLM, or for an encoder its bare `AutoModel` (BertModel)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from serving.models.bert import UNUSED  # the pooler, an MLM head: neither missing nor unexpected matters

    auto = AutoModel if encoder else AutoModelForCausalLM
    quiet_transformers()
    try:
        model, report = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {path}: {one_line(exc)}") from exc
    _check_weights(path, report, UNUSED if encoder else ())
    return model.eval()


def load_model(spec: str = BUNDLED_MODEL, cache_dir: Path | None = None, served_name: str | None = None) -> LoadedModel:
    """Load a model for serving; raises ModelLoadError with a one-line message on failure."""
    from serving.models.registry import architecture, family  # lazily, like torch: importing this stays light
    from serving.models.resolved_config import load_configs
    from serving.models.safetensors_weights import weight_files

    t0 = time.perf_counter()
    cache_dir = cache_dir or default_cache_dir()
    path, converted = prepare_model_dir(spec, cache_dir)
    try:
        config, generation = load_configs(path, cache_dir)
        encoder = family(config).encoder  # before the weights: an unsupported model or config fails fast
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {path}: {one_line(exc)}") from exc
    gguf = _gguf_source(path)
    # the engine builds from the GGUF file or the safetensors themselves (serving.models.*_weights): the
    # transformers model is loaded only if something asks for it (a reference in the tests, --linear torch paths)
    model = (
        LazyHFModel(path, config, generation, encoder)
        if gguf is not None or weight_files(path)
        else _load_weights(path, encoder)
    )
    return LoadedModel(
        model_name(spec, path, served_name),
        model,
        path,
        architecture(config),
        time.perf_counter() - t0,
        converted,
        gguf,
        encoder,
    )


def _check_weights(path: Path, report: dict[str, Any], unused: tuple[str, ...] = ()) -> None:
    """Refuse weights that do not match the architecture exactly.

    transformers fills a missing tensor with random values (and only warns), and skips an
    unexpected one: either would be served as a silently wrong model.  `unused`: prefixes of
    tensors the forward never computes, missing or not (BERT's pooler, a BertForMaskedLM checkpoint's MLM head).
    """
    for kind in LOAD_REPORT:
        names = sorted(
            str(n) for n in report.get(kind) or () if kind == "mismatched_keys" or not str(n).startswith(unused)
        )
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ModelLoadError(
                f"weights in {path} do not match the architecture: {kind.replace('_', ' ')} "
                f"{', '.join(names[:3])}{more}"
            )
