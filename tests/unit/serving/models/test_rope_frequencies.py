"""RoPE frequencies for a model built without its transformers modeling code (a GGUF file) equal what
transformers' own rotary module computes: every served family's default, and the scaled types."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from serving.models.layers.rope import rope_frequencies
from tests.family_models import FAMILIES, build

SCALED = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def transformers_rotary(config):
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    module = importlib.import_module(model_cls.__module__)
    return getattr(module, model_cls.__name__.replace("ForCausalLM", "RotaryEmbedding"))(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_rope_equals_the_families_rotary_module(family):
    config = AutoConfig.from_pretrained(build(family))
    inv_freq, scaling = rope_frequencies(config)
    ref = transformers_rotary(config)
    assert torch.equal(inv_freq, ref.inv_freq) and scaling == ref.attention_scaling


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_scaled_rope_equals_the_rotary_module(kind):
    config = copy.deepcopy(AutoConfig.from_pretrained(build("llama")))
    config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **SCALED[kind]}
    inv_freq, scaling = rope_frequencies(config)
    ref = transformers_rotary(config)
    default, _ = rope_frequencies(AutoConfig.from_pretrained(build("llama")))
    assert not torch.equal(inv_freq, default) or scaling != 1.0  # the scaling changed something
    torch.testing.assert_close(inv_freq, ref.inv_freq, rtol=0, atol=0)
    assert scaling == pytest.approx(ref.attention_scaling)
