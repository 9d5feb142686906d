"""Which model families are served: the HF config's architecture name -> our implementation.

Adding a family is one `Family` entry in FAMILIES plus, where the shared Llama-shaped
decoder does not already compute it, its own small file built from `serving.models.layers`
(docs/engine.md, "Adding a model family").  The loader resolves a model here, config
checks included, before reading its weights; the ModelRunner builds the forward from the
class found here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from serving.model_files import ModelLoadError
from serving.models.base import CausalLM, check_config
from serving.models.bert import BertForward, check_bert_config
from serving.models.llama import LlamaForward
from serving.models.qwen3 import Qwen3Forward


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # transformers' class names in config.json's `architectures`
    impl: type[CausalLM]
    honours: str  # what of the family's configs the engine computes, for `sightline models` and docs
    encoder: bool = False  # bidirectional, no LM head: embeddings only, each input whole in one step
    check: Callable[[Any], None] = check_config  # raises UnsupportedConfig for what the family cannot compute


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        ("LlamaForCausalLM",),
        LlamaForward,
        "Llama 2/3.x, SmolLM2; RoPE default/linear/llama3/yarn; optional attention and MLP biases",
    ),
    Family(
        "qwen2",
        ("Qwen2ForCausalLM",),
        LlamaForward,
        "Qwen2/Qwen2.5; Q/K/V biases; sliding window only when every layer uses it",
    ),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        Qwen3Forward,
        "Qwen3 dense; per-head Q/K RMSNorm; head_dim independent of hidden size",
    ),
    Family(
        "mistral",
        ("MistralForCausalLM",),
        LlamaForward,
        "Mistral; sliding-window attention (sliding_window) or full attention when null",
    ),
    Family(
        "bert",
        ("BertModel", "BertForMaskedLM"),
        BertForward,
        "BERT encoders (all-MiniLM, bge, e5): embeddings only; absolute positions, token type 0, "
        "GELU; pooler and MLM head unused",
        encoder=True,
        check=check_bert_config,
    ),
)
ARCHITECTURES: dict[str, type[CausalLM]] = {a: f.impl for f in FAMILIES for a in f.architectures}
_FAMILY_OF: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}


class UnsupportedArchitecture(ModelLoadError):
    """No implementation for the model's architecture; a ModelLoadError, so the CLIs print its one line."""


def architectures_of(hf_config: Any) -> list[str]:
    """The config's `architectures`.

    A config saved without them (our GGUF conversion writes such a config) names the class
    transformers' AutoModelForCausalLM loads for its `model_type`: that is the model served.
    """
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
        names = [name] if isinstance(name, str) else []
    return names


def architecture(hf_config: Any) -> str:
    """The served architecture's name (the first one registered); raises UnsupportedArchitecture."""
    names = architectures_of(hf_config)
    for name in names:
        if name in ARCHITECTURES:
            return name
    found = ", ".join(repr(n) for n in names) or f"of model_type {getattr(hf_config, 'model_type', None)!r}"
    raise UnsupportedArchitecture(f"unsupported architecture {found}; supported: {', '.join(sorted(ARCHITECTURES))}")


def family(hf_config: Any) -> Family:
    """The served family of a transformers config, its config checked.

    Raises UnsupportedArchitecture naming it and the supported ones, or UnsupportedConfig
    naming the field the engine cannot honour.
    """
    fam = _FAMILY_OF[architecture(hf_config)]
    fam.check(hf_config)
    return fam


def resolve(hf_config: Any) -> type[CausalLM]:
    """The implementation for a transformers config (raises as `family` does)."""
    return family(hf_config).impl
