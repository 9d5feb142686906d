"""Decode and extend attention: the native kernels agree with torch's SDPA, in isolation and inside the engine."""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine.batch import Work, build_batch
from serving.engine.kv_pool import KVPool
from serving.models.layers import decode_attention, native
from serving.models.layers.decode_attention import NativeDecode, sdpa_decode, select
from serving.models.layers.extend_attention import NativeExtend, extend_for, sdpa_extend
from serving.models.layers.forward_batch import ExtendSeg, ForwardBatch
from tests.helpers import PROMPTS, collect, encode, greedy, make_core


@pytest.fixture(scope="module", params=["native", "haswell"])
def kernel(request) -> NativeDecode:
    """This CPU's build, and the AVX2 build (the vector code path of an AVX2-only machine)."""
    lib = native.load(march=request.param)
    if lib is None:  # g++ missing or the build failed: the log says why
        message = "the native decode-attention kernel did not build here (is g++ installed?)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {message}")
        pytest.skip(f"!!! SKIPPED, NOT TESTED !!! {message}")
    return NativeDecode(lib)


def _batch(lengths: list[int], num_slots: int, gen: torch.Generator) -> ForwardBatch:
    lens = torch.tensor(lengths)
    lmax = int(lens.max())
    slots = torch.randperm(num_slots, generator=gen)[: len(lengths) * lmax].view(len(lengths), lmax) + 1
    valid = torch.arange(lmax)[None] < lens[:, None]
    idx = torch.where(valid, slots, 0)
    return ForwardBatch(
        input_ids=torch.zeros(len(lengths), dtype=torch.long),
        positions=lens - 1,
        out_slots=idx[:, 0].clone(),
        num_decode=len(lengths),
        decode_kv_idx=idx,
        decode_lens=lens,
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# vector paths (1 to 8 query heads per K/V head, head_dim a multiple of the vector) and the scalar one
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (4, 2, 24), (12, 1, 24)])
# ragged (padding must not leak into short rows; some of a short row's splits are empty), and
# batches of one or two streams, whose rows the kernel splits among its threads and recombines
@pytest.mark.parametrize("lengths", [[1, 7, 40, 100, 3], [700], [33, 290]])
def test_native_matches_sdpa(kernel, dtype, tol, heads, kv_heads, head_dim, lengths):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_slots = 1200
    k = torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_slots + 1, kv_heads, head_dim, generator=gen).to(dtype)
    k[0] = v[0] = 0  # PAD_SLOT
    fb = _batch(lengths, num_slots, gen)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    want = sdpa_decode(q, k, v, fb).float()
    got = kernel(q, k, v, fb)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_padding_slots_are_never_read(kernel):
    """A request attends only to its own length: garbage beyond it (or in PAD_SLOT) changes nothing."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(201, 2, 16, generator=gen)
    v = torch.randn(201, 2, 16, generator=gen)
    fb = _batch([5, 50], 200, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    before = kernel(q, k, v, fb)
    k[0] = v[0] = float("nan")  # PAD_SLOT: the short row's padding points here
    torch.testing.assert_close(kernel(q, k, v, fb), before)


def _extend_case(
    heads: int, kv_heads: int, d: int, prefix: int, n: int, window: int | None, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExtendSeg]:
    """q [n, heads, d] of a chunk at `prefix` of a request whose slots the engine's allocator scattered over a
    pool of random K/V, and the chunk's segment as the engine builds it (its mask and window)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(1, kv_heads, d, num_slots=600, max_requests=4, max_context=512, dtype=dtype)
    pool.extend(pool.admit(), 0, 37)  # another request's slots first: this one's are not 1, 2, 3...
    row = pool.admit()
    pool.extend(row, 0, prefix)
    fb = build_batch([], [Work(row, prefix, [0] * n, True)], pool, window)
    k, v = (torch.randn(601, kv_heads, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(n, heads, d, generator=gen).to(dtype)
    return q, k, v, fb.extends[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# blocks of 6 // G query tokens over the vector paths (1 to 8 query heads per K/V head) and the scalar one
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (4, 2, 24), (12, 1, 24)])
# a first chunk, chunks after a prefix (a short last block, one token), and sliding windows shorter than
# the prefix and than the chunk
@pytest.mark.parametrize(
    "prefix,n,window", [(0, 17, None), (64, 30, None), (5, 1, None), (200, 61, None), (100, 20, 16), (0, 40, 8)]
)
def test_native_extend_matches_sdpa(kernel, dtype, tol, heads, kv_heads, head_dim, prefix, n, window):
    q, k, v, seg = _extend_case(heads, kv_heads, head_dim, prefix, n, window, dtype, seed=prefix * 7 + n)
    want = sdpa_extend(q, k, v, seg).float()
    got = NativeExtend(kernel.lib)(q, k, v, seg)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_native_extend_is_causal(kernel):
    """A token's output does not move when a later token of its chunk (in the same block or the next) changes."""
    q, k, v, seg = _extend_case(9, 3, 64, 10, 9, None, torch.float32, seed=1)
    ext = NativeExtend(kernel.lib)
    before = ext(q, k, v, seg)
    k[seg.kv_idx[-2:]] += 5.0
    v[seg.kv_idx[-2:]] -= 3.0
    after = ext(q, k, v, seg)
    torch.testing.assert_close(after[:-2], before[:-2], atol=0, rtol=0)
    assert not torch.allclose(after[-2:], before[-2:])


def test_engine_tokens_identical_with_either_backend(tiny, kernel):
    prompts = [encode(tiny, p) for p in PROMPTS] + [encode(tiny, " ".join(PROMPTS))]
    outs = {}
    for backend in ("sdpa", "native"):
        core = make_core(tiny, attention_backend=backend, max_prefill_tokens=16)
        assert isinstance(core.runner.decode_attention, NativeDecode) == (backend == "native")
        assert isinstance(core.runner.extend_attention, NativeExtend) == (backend == "native")
        for i, ids in enumerate(prompts):
            core.add_request(f"r{i}", ids, greedy(24, ignore_eos=True))
        outs[backend] = collect(core)
    assert outs["native"] == outs["sdpa"]
    assert all(len(toks) == 24 for toks in outs["native"].values())


def test_select_falls_back_to_sdpa_when_the_kernel_cannot_build(monkeypatch):
    monkeypatch.setattr(decode_attention.native, "load", lambda cache_dir=None: None)
    fn, why = select("auto")
    assert fn is sdpa_decode and "did not build" in why
    assert extend_for(fn) is sdpa_extend  # the extend kernel lives in the same library
    with pytest.raises(RuntimeError, match="could not be built"):
        select("native")
    assert select("sdpa")[0] is sdpa_decode
    with pytest.raises(ValueError):
        select("flash")


def test_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build()


@pytest.mark.parametrize("march", ["native", "haswell"])
def test_build_is_cached_per_source(monkeypatch, tmp_path, march):
    """The cache logic on a one-function stub (the real kernels take ~30 s to compile on 2 cores), for each
    target the kernels are built for."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "stub.cpp").write_text('extern "C" int sightline_stub() { return 1; }\n')
    cache = tmp_path / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    first = native.build(march=march, kernels=src)
    mtime = first.stat().st_mtime_ns
    assert native.build(march=march, kernels=src) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in cache.iterdir()] == [first.name]  # no temporary files left behind
    (src / "stub.cpp").write_text('extern "C" int sightline_stub() { return 2; }\n')
    second = native.build(march=march, kernels=src)  # another source: another library, the first kept
    assert second != first and sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name])
