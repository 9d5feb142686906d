"""The native RMSNorm (kernels/norm.cpp), alone and fused with the residual add, against torch's
(transformers' op order): float32 sums in another order, so within 1e-5, at every row count
(one, a partial chunk of rows, several chunks) and odd widths; and the engine takes it with the
native linear layers, not without."""

from __future__ import annotations

import pytest
import torch

from serving.models.layers import native
from serving.models.layers.norm import NativeNorm, RMSNorm, rms_norm
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
