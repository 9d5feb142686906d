"""The decode stack (every layer of a decode-only step in one native call) against the layer-by-layer
forward on every family's seeded model: the same logits and the same K/V, bit for bit, for a batch of
requests of different lengths, in float32 and on quantized weights; where it does not apply, the model
keeps its Python forward; the native SiLU·mul against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.args import ServerArgs
from serving.engine.batch import Work
from serving.engine.loader import load_model
from serving.engine.model_runner import ModelRunner
from serving.models.layers import native
from serving.models.layers.activation import NativeSiluMul
from tests.family_models import FAMILIES, build

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the hill.",
    "In 1969, the first humans walked on the Moon; millions watched it live.",
    "def add(a, b):\n    return a + b",
]

pytestmark = pytest.mark.skipif(native.load() is None, reason="no native kernels here")


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    return load_model(str(build(request.param)))


def _runner(model, **kw) -> ModelRunner:
    return ModelRunner(
        model, ServerArgs(model=model.name, max_total_tokens=1024, max_running_requests=8, dtype="float32", **kw)
    )


def _decode(runner: ModelRunner, work: list[Work], stacked: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of one decode step and the K rows it wrote, through the stack or layer by layer."""
    model, stack = runner.model, runner.model.stack
    model.stack = stack if stacked else None
    try:
        logits = runner.forward(work, [])
    finally:
        model.stack = stack
    slots = runner.pool.req_to_token[torch.tensor([w.row for w in work]), torch.tensor([w.start for w in work])]
    return logits, [k[slots].clone() for k in runner.pool.kv.k] + [v[slots].clone() for v in runner.pool.kv.v]


@pytest.mark.parametrize("quantization", ["none", "q8_0", "q4_k"])
def test_stack_equals_layer_by_layer_bit_for_bit(fam, quantization):
    runner = _runner(fam, quantization=quantization)
    assert runner.model.stack is not None
    prompts = [fam.tokenizer(t)["input_ids"] for t in TEXTS]
    rows = [runner.pool.admit(len(p) + 8) for p in prompts]
    logits = runner.forward([], [Work(r, 0, p, True) for r, p in zip(rows, prompts)])
    seqs = [list(p) for p in prompts]
    for _ in range(4):  # several steps: lengths differ, so the slot table is padded
        nxt = logits.argmax(-1).tolist()
        work = [Work(r, len(s), [t], True) for r, s, t in zip(rows, seqs, nxt)]
        ref, ref_kv = _decode(runner, work, stacked=False)
        logits, kv = _decode(runner, work, stacked=True)
        assert torch.equal(logits, ref)
        assert all(torch.equal(a, b) for a, b in zip(kv, ref_kv))
        for s, t in zip(seqs, nxt):
            s.append(t)


def test_the_stack_runs_decode_only_steps(fam):
    runner = _runner(fam)
    stack, calls = runner.model.stack, []
    runner.model.stack = type(
        "Counting",
        (),
        {
            "runs": lambda self, fb, kv: calls.append(stack.runs(fb, kv)) or calls[-1],
            "__call__": lambda self, *a: stack(*a),
        },
    )()
    p = fam.tokenizer(TEXTS[0])["input_ids"]
    r0, r1 = runner.pool.admit(len(p) + 4), runner.pool.admit(len(p) + 4)
    logits = runner.forward([], [Work(r0, 0, p, True)])
    t = int(logits.argmax(-1))
    runner.forward([Work(r0, len(p), [t], True)], [Work(r1, 0, p, True)])  # a decode beside a prefill
    runner.forward([Work(r0, len(p) + 1, [t], True), Work(r1, len(p), [t], True)], [])
    assert calls == [False, False, True]


def test_no_stack_without_native_float32_layers():
    model = load_model("tiny-random")
    assert _runner(model, linear_backend="torch").model.stack is None
    assert ModelRunner(model, ServerArgs(model=model.name, max_total_tokens=256, dtype="bfloat16")).model.stack is None
    assert _runner(model, enforce_eager=True).model.stack is None


@pytest.mark.parametrize("rows,n", [(1, 1536), (3, 7), (64, 1536), (5, 40000)])
def test_native_silu_mul_matches_torch(rows, n):
    lib = native.load()
    gen = torch.Generator().manual_seed(rows * n)
    gu = torch.randn(rows, 2 * n, generator=gen) * 8
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])  # saturating, zero and subnormal-adjacent inputs
    out = NativeSiluMul(lib)(gu)
    g, u = gu.double().chunk(2, dim=-1)
    ref = F.silu(g) * u
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=3e-7)
