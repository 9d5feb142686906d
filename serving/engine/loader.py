"""Load a model's weights for the engine (Scheduler process): a transformers model in fp32.

Where the model comes from (bundled GGUF, tiny-random, a local directory) and its
one-time conversion are `serving.model_files`; which architectures are served is the
model registry (`serving.models.registry`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.model_files import BUNDLED_MODEL, ModelLoadError, model_name, one_line, prepare_model_dir

LOAD_REPORT = ("missing_keys", "unexpected_keys", "mismatched_keys")


@dataclass
class LoadedModel:
    name: str  # the name clients use in the `model` field
    hf_model: Any  # a transformers *ForCausalLM, fp32, eval mode
    tokenizer: Any
    path: Path  # the HF directory the weights were read from
    architecture: str  # the registered architecture served, e.g. LlamaForCausalLM
    load_seconds: float
    converted: bool  # True when this load had to convert (cold start)


def load_model(spec: str = BUNDLED_MODEL, cache_dir: Path | None = None, served_name: str | None = None) -> LoadedModel:
    """Load a model for serving; raises ModelLoadError with a one-line message on failure."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from serving.models.registry import architecture, resolve  # lazily, like torch: importing this stays light

    t0 = time.perf_counter()
    path, converted = prepare_model_dir(spec, cache_dir)
    try:
        config = AutoConfig.from_pretrained(path)
        resolve(config)  # before the weights: an unsupported model or config fails fast
        tokenizer = AutoTokenizer.from_pretrained(path)
        model, report = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load model from {path}: {one_line(exc)}") from exc
    _check_weights(path, report)
    return LoadedModel(model_name(spec, path, served_name), model.eval(), tokenizer, path, architecture(config),
                       time.perf_counter() - t0, converted)


def _check_weights(path: Path, report: dict[str, Any]) -> None:
    """Refuse weights that do not match the architecture exactly.

    transformers fills a missing tensor with random values (and only warns), and skips an
    unexpected one: either would be served as a silently wrong model.
    """
    for kind in LOAD_REPORT:
        names = sorted(str(n) for n in report.get(kind) or ())
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ModelLoadError(f"weights in {path} do not match the architecture: {kind.replace('_', ' ')} "
                                 f"{', '.join(names[:3])}{more}")

