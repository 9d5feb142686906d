"""The native small ops against torch's: RMSNorm (kernels/norm.cpp), alone and fused with the
residual add (transformers' op order in torch; float32 sums in another order, so within 1e-5), at
every row count (one, a partial chunk of rows, several chunks) and odd widths; RoPE fused with the
K/V store (kernels/rope.cpp); and the engine takes them with the native linear layers, not without."""

from __future__ import annotations

import pytest
import torch

from serving.models.layers import native
from serving.models.layers.norm import NativeNorm, RMSNorm, rms_norm
from serving.models.layers.rope import NativeRope, RotaryTables, apply_rotary
from tests.helpers import make_core


@pytest.fixture(scope="module")
def kernel() -> NativeNorm:
    lib = native.load()
    if lib is None:
        pytest.fail("the native kernels did not build here (is g++ installed?)")
    return NativeNorm(lib)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 100])
@pytest.mark.parametrize("d", [1, 7, 64, 576, 1000])
def test_norm_and_fused_add_match_torch(kernel, m, d):
    gen = torch.Generator().manual_seed(m * 10_000 + d)
    x, delta = torch.randn(m, d, generator=gen) * 3, torch.randn(m, d, generator=gen)
    w = torch.randn(d, generator=gen)
    h, y = kernel(x, w, 1e-5)
    assert h is None
    torch.testing.assert_close(y, rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    norm = RMSNorm(w, 1e-5, kernel)
    h, y = norm.add(x, delta)
    assert torch.equal(h, x + delta)  # one float add per element: exact
    torch.testing.assert_close(y, rms_norm(x + delta, w, 1e-5), atol=1e-5, rtol=1e-5)


def test_views_and_3d_inputs(kernel):
    """Per-head Q/K norms get [T, H, d] slices of the fused QKV output: not contiguous."""
    qkv = torch.randn(5, 3 * 64 * 4)
    q = qkv[:, :256].view(5, 4, 64)
    w = torch.randn(64)
    torch.testing.assert_close(RMSNorm(w, 1e-6, kernel)(q), rms_norm(q, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_bf16_stays_on_torch(kernel):
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(RMSNorm(w, 1e-6, kernel)(x), rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_engine_uses_it_with_native_linear_layers(tiny, backend):
    model = make_core(tiny, linear_backend=backend).runner.model
    assert (model.final_norm.kernel is not None) == (backend == "native")
    assert all((layer.mlp_norm.kernel is not None) == (backend == "native") for layer in model.layers)
    assert all((layer.attn.rope_kernel is not None) == (backend == "native") for layer in model.layers)


@pytest.mark.parametrize("t,heads,kv_heads,d", [(1, 9, 3, 64), (13, 4, 4, 32), (40, 8, 1, 16)])
def test_rope_and_kv_store_match_torch(t, heads, kv_heads, d):
    """The fused RoPE + K/V store against apply_rotary and indexed stores, on views of a fused QKV row."""
    rope = NativeRope(native.load())
    gen = torch.Generator().manual_seed(t + heads)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    tables = RotaryTables.build(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0, 64)
    cos, sin = tables.at(torch.randint(0, 64, (t,), generator=gen))
    slots = torch.randperm(100, generator=gen)[:t]
    k_pool, v_pool = torch.zeros(100, kv_heads, d), torch.zeros(100, kv_heads, d)
    q_out = rope(q, k, v, cos, sin, k_pool, v_pool, slots)
    torch.testing.assert_close(q_out, apply_rotary(q, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_pool[slots], apply_rotary(k, cos, sin), atol=1e-5, rtol=1e-5)
    assert torch.equal(v_pool[slots], v)
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()
