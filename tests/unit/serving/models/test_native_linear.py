"""The native fp32 linear kernel against torch's matmul at every shape class (M of one row, of a
partial register tile, of several cache blocks; N not a multiple of the panel; odd K), and inside
the engine: the bundled model's greedy tokens agree with torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.args import ServerArgs
from serving.models.layers import native, native_linear
from serving.models.layers.linear import FusedLinear, Precision
from serving.models.layers.native_ops import NativeKernels
from tests.helpers import collect, encode, greedy, make_core

# Each output is a K-term fp32 dot product; summation order differs from the BLAS's, so the error
# is bounded by a few ulps per term: |y - ref| <= 1e-6 · sqrt(K) · max|x|·max|w|·K^0.5 (values ~N(0,1)/sqrt(K)).
TOL = 2e-5


@pytest.fixture(scope="module")
def kernel() -> native_linear.NativeLinear:
    lib = native.load()
    if lib is None:
        pytest.fail("the native linear kernel did not build here (is g++ installed, with AVX2 and FMA?)")
    return native_linear.NativeLinear(lib)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 48, 49, 100])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 13), (32, 64), (33, 576), (960, 576), (1000, 97), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_torch(kernel, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    y = kernel(x, kernel.pack(w), kernel.pad_bias(b, n), n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), atol=TOL, rtol=TOL)


def test_packing_pads_to_whole_panels_with_zeros(kernel):
    w = torch.arange(1, 35 * 3 + 1, dtype=torch.float32).view(35, 3)
    packed = kernel.pack(w)
    p = kernel.panel
    assert packed.shape == (-(-35 // p), 3, p)
    unpacked = packed.transpose(1, 2).reshape(-1, 3)  # back to [padded N, K]
    assert torch.equal(unpacked[:35], w)
    assert unpacked.shape[0] % p == 0 and torch.count_nonzero(unpacked[35:]) == 0  # padding holds zeros


def test_batched_leading_dims_and_empty_input(kernel):
    w = torch.randn(40, 24)
    packed = kernel.pack(w)
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(kernel(x, packed, None, 40), F.linear(x, w), atol=TOL, rtol=TOL)
    assert kernel(torch.empty(0, 24), packed, None, 40).shape == (0, 40)


def test_fused_linear_takes_the_kernel_for_float32_only(kernel):
    lin = torch.nn.Linear(24, 40)
    native = NativeKernels.of(kernel.lib)
    fused = FusedLinear.of(lin, precision=Precision("float32", native=native))
    assert fused.kernel is native.linear and fused.weight is None and fused.packed is not None
    x = torch.randn(5, 24)
    torch.testing.assert_close(fused(x), lin(x).detach(), atol=TOL, rtol=TOL)
    assert FusedLinear.of(lin, precision=Precision("bfloat16", native=native)).kernel is None


def test_backend_selection_says_why(kernel):
    assert native_linear.select("torch", "float32", "none")[0] is None
    k, why = native_linear.select("auto", "float32", "none")
    assert k is not None and "native" in why
    assert native_linear.select("auto", "bfloat16", "none")[0] is None
    with pytest.raises(RuntimeError):
        native_linear.select("native", "bfloat16", "none")
    with pytest.raises(ValueError):
        ServerArgs(linear_backend="blas")


def test_the_kernel_cache_honours_cache_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "stub.cpp").write_text('extern "C" int sightline_stub() { return 1; }\n')  # the cache, not the kernels
    lib = native.build(tmp_path, kernels=src)
    assert lib.parent == tmp_path / "kernels" and lib.exists()


def test_engine_uses_the_kernel_and_keeps_torchs_tokens(tiny):
    """tiny-random: every token identical over a mixed batch (its logits are far apart)."""
    outs = {}
    for backend in ("torch", "native"):
        core = make_core(tiny, linear_backend=backend, max_prefill_tokens=16)
        assert (core.runner.model.lm_head.kernel is not None) == (backend == "native")
        for i, text in enumerate(["The capital of France is", "1, 2, 3,", "Once upon a time, in a land far"]):
            core.add_request(f"r{i}", encode(tiny, text), greedy(24))
        outs[backend] = collect(core)
    assert outs["native"] == outs["torch"]


SUBJECTS = [
    "the sea",
    "a mountain",
    "the moon",
    "a city at night",
    "an old library",
    "the first snow",
    "a train station",
    "a garden",
    "the desert",
    "a thunderstorm",
]
FORMS = [
    "Write a haiku about {}.",
    "Describe {} in one sentence.",
    "Tell a short story about {}.",
    "List three facts about {}.",
    "What does {} sound like?",
]


@pytest.mark.smollm
@pytest.mark.timeout(600)  # ~30 s alone on 2 cores; ~110 s beside other work (load 7)
def test_bundled_model_greedy_tokens_agree_with_torch(smollm):
    """25 prompts (every form, every other subject), 64 greedy tokens each, batched as the server batches them:
    the native kernel sums in another order than torch's BLAS, so a near-tie between two tokens may flip and
    the rest of that request then differs; at least 96 % of the requests (24 of 25, the share 48 of 50 is) must
    be identical throughout (on AVX2 all 50 FORMS x SUBJECTS prompts are).  The pool holds every request at
    once, as the default one does: no retraction, whose recomputation would differ for reasons of its own."""
    prompts = [f.format(s) for f in FORMS for s in SUBJECTS[::2]]
    outs = {}
    for backend in ("torch", "native"):
        core = make_core(smollm, linear_backend=backend, max_total_tokens=4096)
        assert (core.runner.model.lm_head.kernel is not None) == (backend == "native")
        for i, text in enumerate(prompts):
            core.add_request(f"r{i}", encode(smollm, text), greedy(64, ignore_eos=True))
        outs[backend] = collect(core)
        assert core.retractions == 0
    assert len(outs["torch"]) == 25 and all(len(t) == 64 for t in outs["torch"].values())
    same = sum(outs["native"][rid] == toks for rid, toks in outs["torch"].items())
    assert same >= 24, f"{same} of 25 requests identical"
