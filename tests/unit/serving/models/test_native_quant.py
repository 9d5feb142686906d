"""The quantized linear kernel against dequantize-then-matmul, for every type it runs, built for this
CPU and for AVX2 alone (`march="haswell"`: the code path of CPUs without AVX-512 or VNNI).

Two references: gguf-py's dequantized weight times x quantized exactly as the kernel does (then only
fp32 summation order differs: tight bound), and times x itself (bounded by half a rounding step of
each activation block times |w|).  Weights are random blocks (every bit pattern a file may hold,
fp16 scales made finite) and, where gguf-py or `quantize` has a quantizer, quantized random values.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from serving.models.layers import native_quant
from serving.models.layers.native_quant import QuantLinear, QuantWeight
from serving.models.layers.quantize import AT_LOAD, dequantize, quantize

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FP16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}  # byte offsets of each block's fp16 scales


@pytest.fixture(scope="module", params=["native", "haswell"])
def kernel(request) -> native_quant.QuantKernel:
    k = native_quant.load(march=request.param)
    if k is None:
        pytest.fail(f"the quantized kernel did not build for -march={request.param}")
    return k


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> QuantWeight:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.02, size=(n, k // block)).astype(np.float16)
        data[:, :, off : off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return QuantWeight(qtype, torch.from_numpy(data.reshape(n, -1)), k)


def check(kernel, weights: list[QuantWeight], m: int, seed: int) -> None:
    k = weights[0].cols
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 20  # an outlier channel: costs precision only inside its 32-value blocks
    w = torch.cat([dequantize(p) for p in weights])
    d, _, q = kernel.activations(x)
    x_int8 = (q.float().view(m, -1, 32) * d[..., None]).view(m, k)
    y = QuantLinear(kernel, weights)(x)
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32
    exact = x_int8.double() @ w.double().T
    scale = (x_int8.abs().double() @ w.abs().double().T).clamp(min=1e-6)
    assert ((y.double() - exact).abs() / scale).max() < 1e-5  # fp32 summation order only
    # x's rounding: at most half a step (d / 2) per value, times |w|
    half_step = (d / 2).repeat_interleave(32, dim=1)
    assert ((y - x @ w.T).abs() <= half_step @ w.abs().T * 1.001 + 1e-5).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n", [(1, 1), (1, 37), (2, 8), (3, 5), (4, 64), (5, 13), (9, 4), (33, 70)])
def test_random_blocks_match_the_reference(kernel, qtype, m, n):
    k = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 96
    check(kernel, [random_blocks(qtype, n, k, seed=m * 100 + n)], m, seed=n)


@pytest.mark.parametrize("name", list(AT_LOAD))
# the last: several threads, three blocks of x rows
@pytest.mark.parametrize("m,n,k", [(1, 13, 512), (6, 40, 768), (17, 9, 1536), (300, 66, 1536)])
def test_quantized_values_match_the_reference(kernel, name, m, n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    qw = quantize(w, name)
    assert qw.qtype == AT_LOAD[name] and qw.data.shape == (n, k // qw.block * gguf.GGML_QUANT_SIZES[qw.qtype][1])
    assert (dequantize(qw) - w).abs().max() < (0.002 if name == "q8_0" else 0.03)
    check(kernel, [qw], m, seed=k)


def test_parts_of_mixed_types_fill_their_columns(kernel):
    """One call over Q5_0, Q5_0 and Q8_0 parts (Q4_K_M's Q/K/V), x quantized once."""
    k = 576
    parts = [random_blocks(Q.Q5_0, 24, k, 1), random_blocks(Q.Q5_0, 8, k, 2), random_blocks(Q.Q8_0, 8, k, 3)]
    check(kernel, parts, m=7, seed=4)
    x = torch.randn(2, 3, k)
    bias = torch.randn(40)
    y = QuantLinear(kernel, parts, bias)(x)
    want = torch.cat([QuantLinear(kernel, [p])(x) for p in parts], dim=-1) + bias
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert QuantLinear(kernel, parts)(torch.empty(0, k)).shape == (0, 40)
    assert QuantLinear(kernel, parts)(x.bfloat16()).dtype == torch.bfloat16


def test_activation_blocks_round_like_q8_0(kernel):
    x = torch.randn(3, 64)
    d, s, q = kernel.activations(x)
    blocks = x.view(3, 2, 32)
    torch.testing.assert_close(d, blocks.abs().amax(-1) / 127)
    assert torch.equal(q.view(3, 2, 32), torch.round(blocks / d[..., None]).to(torch.int8))
    torch.testing.assert_close(s, d * q.view(3, 2, 32).float().sum(-1))
    assert torch.count_nonzero(kernel.activations(torch.zeros(1, 32))[2]) == 0  # no NaN from a zero block


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_gguf_pys(kernel, qtype):
    w = random_blocks(qtype, 11, 512, seed=5)
    ids = torch.tensor([[3, 0], [10, 3]])
    torch.testing.assert_close(kernel.dequant_rows(w, ids), dequantize(w)[ids], atol=0, rtol=0)


def test_unrunnable_weights_are_refused(kernel):
    assert not kernel.supports(Q.Q2_K) and not kernel.supports(Q.F16)
    with pytest.raises(ValueError):
        QuantLinear(kernel, [random_blocks(Q.Q8_0, 4, 64, 0), random_blocks(Q.Q8_0, 4, 96, 0)])
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 576), "q4_k")  # 576 is not a multiple of 256


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_these_types_interleave_and_keep_every_value(kernel, qtype):
    """These types run repacked, 16 rows per group (one 512-bit `vpdpbusd` with AVX-512 VNNI, two
    256-bit halves on AVX2); their row lookups (a tied embedding reads the repacked lm_head) give
    the file's values exactly, and the repacked kernel equals the row-major one within rounding."""
    w = random_blocks(qtype, 37, 512, seed=7)
    packed = kernel.interleave(w)
    assert packed is not None and packed.qtype == qtype and packed.rows == 37
    linear = QuantLinear(kernel, [w])
    assert isinstance(linear.parts[0], native_quant.PackedWeight)
    ids = torch.tensor([0, 15, 16, 36, 5])
    assert torch.equal(kernel.dequant_rows(packed, ids), dequantize(w)[ids])
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    row_major = kernel.matmul(x, native_quant._Parts([w]))
    torch.testing.assert_close(linear(x), row_major, atol=1e-4, rtol=1e-5)
