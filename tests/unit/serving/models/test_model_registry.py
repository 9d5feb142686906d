"""The model registry and the shared layers: resolution, clear refusals, and each layer equal to transformers'."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from serving.engine.batch import Work, build_batch
from serving.engine.kv_pool import KVPool
from serving.engine.loader import load_model
from serving.model_files import ModelLoadError
from serving.models.layers.attention import paged_attention
from serving.models.layers.linear import FusedLinear
from serving.models.layers.mlp import GatedMLP
from serving.models.layers.norm import rms_norm
from serving.models.layers.rope import RotaryTables, apply_rotary
from serving.models.llama import LlamaForward
from serving.models.registry import ARCHITECTURES, UnsupportedArchitecture, resolve
from tests.helpers import REPO

MODELS = REPO / "serving" / "models"


# -- registry -------------------------------------------------------------
def test_served_models_resolve_to_llama(tiny, smollm):
    for model in (tiny, smollm):
        assert resolve(model.hf_model.config) is LlamaForward
        assert resolve(AutoConfig.from_pretrained(model.path)) is LlamaForward
    # The cached GGUF conversion has no `architectures`: its model_type decides.
    assert not AutoConfig.from_pretrained(smollm.path).architectures
    assert AutoConfig.from_pretrained(tiny.path).architectures == ["LlamaForCausalLM"]


def test_unknown_architecture_is_named_with_the_supported_ones():
    with pytest.raises(UnsupportedArchitecture) as err:
        resolve(GPT2Config(architectures=["GPT2LMHeadModel"]))
    msg = str(err.value)
    assert "'GPT2LMHeadModel'" in msg and "LlamaForCausalLM" in msg and "\n" not in msg
    assert isinstance(err.value, ModelLoadError)


def test_first_supported_architecture_wins_and_unknown_model_type_is_named():
    assert resolve(LlamaConfig(architectures=["SomethingElse", "LlamaForCausalLM"])) is LlamaForward
    with pytest.raises(UnsupportedArchitecture, match="model_type 'no-such-type'"):
        resolve(type("Cfg", (), {"architectures": None, "model_type": "no-such-type"})())


def test_every_entry_implements_the_engine_interface():
    for impl in ARCHITECTURES.values():
        assert callable(impl.from_hf) and callable(impl.forward)


def _gpt2_config_only(path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16).save_pretrained(path)


def _gpt2_with_weights(path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16)).save_pretrained(path)


@pytest.mark.parametrize("write", [_gpt2_config_only, _gpt2_with_weights])
def test_load_model_refuses_an_unsupported_architecture(tmp_path, write):
    """Checked from config.json before weights or tokenizer are read: neither matters to the message."""
    write(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert str(err.value) == (
        "unsupported architecture 'GPT2LMHeadModel'; supported: BertForMaskedLM, BertModel, "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )


def test_models_do_not_import_the_engine():
    for path in MODELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            assert not [n for n in names if n.startswith("serving.engine")], path


# -- layers vs transformers ----------------------------------------------
def test_rms_norm_equals_transformers():
    torch.manual_seed(0)
    ref = LlamaRMSNorm(64, eps=1e-5)
    ref.weight.data = torch.randn(64)
    x = torch.randn(7, 64) * 3
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, ref.weight, 1e-5), ref(x), atol=0, rtol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rope_equals_transformers(rope):
    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope
    )
    hf = LlamaRotaryEmbedding(cfg)
    if rope["rope_type"] == "yarn":
        assert hf.attention_scaling != 1.0  # the scaling is exercised
    tables = RotaryTables.from_hf(hf, cfg.max_position_embeddings)
    torch.manual_seed(0)
    pos = torch.randint(0, cfg.max_position_embeddings, (9,))
    q, k = torch.randn(1, 4, 9, 16), torch.randn(1, 2, 9, 16)  # transformers' [B, heads, T, d]
    cos_ref, sin_ref = hf(q, pos[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    cos, sin = tables.at(pos)  # ours: [T, 1, d] against [T, heads, d]
    torch.testing.assert_close(cos[:, 0], cos_ref[0])
    torch.testing.assert_close(sin[:, 0], sin_ref[0])
    torch.testing.assert_close(apply_rotary(q[0].transpose(0, 1), cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k[0].transpose(0, 1), cos, sin), k_ref[0].transpose(0, 1))


def test_gated_mlp_equals_transformers():
    torch.manual_seed(0)
    ref = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=80, mlp_bias=True)).eval()
    ours = GatedMLP(FusedLinear.of(ref.gate_proj, ref.up_proj), FusedLinear.of(ref.down_proj))
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))


def test_fused_linear_is_its_parts_concatenated():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(16, 8, bias=True), torch.nn.Linear(16, 4, bias=False), torch.nn.Linear(16, 4)]
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(FusedLinear.of(*parts)(x), torch.cat([p(x) for p in parts], dim=-1))
    assert FusedLinear.of(torch.nn.Linear(4, 4, bias=False)).bias is None


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: plain causal attention over one contiguous sequence, K/V heads repeated. [L, heads, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(len(q), len(q), dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_paged_attention_equals_dense_causal_attention():
    """Two requests through the engine's slot allocator: a prefill, then a decode beside a prefix-extending chunk."""
    torch.manual_seed(0)
    heads, kv_heads, d, la, lb = 4, 2, 8, 6, 7
    pool = KVPool(1, kv_heads, d, num_slots=64, max_requests=2, max_context=32)
    qkv = {
        r: (torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d))
        for r, n in (("a", la), ("b", lb))
    }
    ra, rb = pool.admit(16), pool.admit(16)
    out: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    def step(decodes: list[Work], extends: list[Work], pieces: list[tuple[str, int, int]]) -> None:
        """Feed positions [start, stop) of each request in `pieces` (in batch order); keep their outputs."""
        fb = build_batch(decodes, extends, pool)
        q, k, v = (torch.cat([qkv[r][i][start:stop] for r, start, stop in pieces]) for i in range(3))
        o = paged_attention(q, k, v, pool.kv, 0, fb)
        for (r, start, stop), part in zip(pieces, o.split([stop - start for _, start, stop in pieces])):
            out[r].append(part)

    step([], [Work(ra, 0, [0] * (la - 1), True), Work(rb, 0, [0] * 3, False)], [("a", 0, la - 1), ("b", 0, 3)])
    step([Work(ra, la - 1, [0], True)], [Work(rb, 3, [0] * (lb - 3), True)], [("a", la - 1, la), ("b", 3, lb)])
    for r in ("a", "b"):
        torch.testing.assert_close(torch.cat(out[r]), _dense_causal(*qkv[r]), atol=1e-5, rtol=1e-5)
