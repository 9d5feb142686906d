"""Which model families are served: the HF config's architecture name -> our implementation.

Adding a family is one entry in ARCHITECTURES plus its own file built from
`serving.models.layers`.  The loader checks a model here before reading its weights, and
the ModelRunner builds the forward from the class found here.
"""

from __future__ import annotations

from typing import Any

from serving.model_files import ModelLoadError
from serving.models.base import CausalLM
from serving.models.llama import LlamaForward

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForward,
}


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


def resolve(hf_config: Any) -> type[CausalLM]:
    """The implementation for a transformers config; raises UnsupportedArchitecture naming it and the supported ones."""
    names = architectures_of(hf_config)
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    found = ", ".join(repr(n) for n in names) or f"of model_type {getattr(hf_config, 'model_type', None)!r}"
    raise UnsupportedArchitecture(f"unsupported architecture {found}; supported: {', '.join(sorted(ARCHITECTURES))}")
