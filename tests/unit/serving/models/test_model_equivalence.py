"""Our paged, batched Llama forward must give transformers' logits on the same weights."""

from __future__ import annotations

import torch

from serving.args import ServerArgs
from serving.engine.batch import Work
from serving.engine.model_runner import ModelRunner
from tests.helpers import PROMPTS, decode_argmax, encode, one_thread

ATOL = 2e-4  # fp32; SmolLM2's logits reach ~20, observed max error ~6e-5


def _hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode(), one_thread():
        return model.hf_model(torch.tensor([ids])).logits[0, -1]


def test_prefill_and_decode_logits_match_transformers(any_model):
    runner = ModelRunner(
        any_model,
        ServerArgs(
            model=any_model.name, max_total_tokens=2048, max_running_requests=8, dtype="float32", quantization="none"
        ),
    )
    prompts = [encode(any_model, p) for p in PROMPTS[:3]]
    rows = [runner.pool.admit(len(p) + 8) for p in prompts]
    seqs = [list(p) for p in prompts]
    # Prefill: all three prompts as extend chunks of one ragged batch.
    logits = runner.forward([], [Work(r, 0, p, True) for r, p in zip(rows, prompts)])
    assert logits.shape == (3, any_model.hf_model.config.vocab_size)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], _hf_last_logits(any_model, s), atol=ATOL, rtol=1e-4)
    # Several decode steps, batched, with sequences of different lengths.
    for _ in range(4):
        logits = decode_argmax(runner, rows, seqs, logits)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], _hf_last_logits(any_model, s), atol=ATOL, rtol=1e-4)


def test_mixed_batch_decode_beside_prefill(tiny):
    """A decode token and a prefix-extending chunk in one ragged batch stay exact."""
    runner = ModelRunner(
        tiny, ServerArgs(model=tiny.name, max_total_tokens=1024, max_running_requests=4, dtype="float32")
    )
    a, b = encode(tiny, PROMPTS[0]), encode(tiny, PROMPTS[1])
    ra, rb = runner.pool.admit(64), runner.pool.admit(64)
    runner.forward([], [Work(ra, 0, a, True), Work(rb, 0, b[:5], False)])  # b: first chunk only
    logits = runner.forward([Work(ra, len(a), [7], True)], [Work(rb, 5, b[5:], True)])
    torch.testing.assert_close(logits[0], _hf_last_logits(tiny, a + [7]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[1], _hf_last_logits(tiny, b), atol=ATOL, rtol=1e-4)
