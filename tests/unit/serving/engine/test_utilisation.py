"""The analytic FLOP and byte count of a step, against the real tiny-random model: its linear weights counted
from the checkpoint itself, and a decode step's FLOPs against torch's own FLOP counter over the same shapes."""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from serving.engine.utilisation import ModelShape, chunk_pairs, phase_work, step_work


def _shape(loaded) -> ModelShape:
    return ModelShape.from_hf_config(loaded.hf_model.config)


def test_linear_weights_match_the_checkpoint(tiny):
    shape = _shape(tiny)
    with safe_open(str(tiny.path / "model.safetensors"), "pt") as f:
        counted = sum(
            f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1]
            for k in f.keys()
            if k.startswith("model.layers.") and k.endswith("proj.weight")
        )
    assert counted == shape.layer_params * shape.num_layers > 0


def test_a_decode_step_against_torchs_flop_counter(tiny):
    """Batch B of decodes, request i attending to ctx[i] positions: the same matrix products in torch."""
    s, ctx = _shape(tiny), [5, 9, 17]
    flops = FlopCounterMode(display=False)
    with flops, torch.no_grad():
        for _ in range(s.num_layers):
            x = torch.zeros(len(ctx), s.hidden)
            for a, b in s.linears():
                torch.nn.functional.linear(torch.zeros(len(ctx), a), torch.zeros(b, a))
            for c in ctx:  # scores q·K over the context, then the weighted sum of V: per head
                q, k = torch.zeros(s.num_heads, 1, s.head_dim), torch.zeros(s.num_heads, c, s.head_dim)
                torch.bmm(torch.bmm(q, k.transpose(1, 2)), k)
        torch.nn.functional.linear(x, torch.zeros(s.vocab_size, s.hidden))  # the LM head
    work = step_work(s, tokens=len(ctx), sampled=len(ctx), attended=sum(ctx), contexts=sum(ctx))
    assert work.flops == flops.get_total_flops()
    # a decode step is dominated by 2 · params · B plus attention: the hand count
    assert (
        work.flops
        == 2 * (s.layer_params * s.num_layers + s.head_params) * len(ctx)
        + 4 * s.num_heads * s.head_dim * sum(ctx) * s.num_layers
    )


def test_bytes_weights_once_kv_by_context_and_prefill_pairs(tiny):
    s = _shape(tiny)
    one, two = step_work(s, 1, 1, 10, 10), step_work(s, 2, 2, 20, 20)
    weights = (s.layer_params * s.num_layers + s.head_params) * 4
    assert one.bytes > weights and two.bytes - one.bytes < one.bytes - weights + 1  # weights are read once a step
    assert step_work(s, 0, 0, 0, 0).flops == 0
    assert chunk_pairs(0, 4) == 1 + 2 + 3 + 4 and chunk_pairs(3, 2) == 4 + 5  # causal: each token sees itself
    half = ModelShape(**{**s.__dict__, "weight_bytes": 2.0})
    assert step_work(s, 1, 1, 10, 10).bytes - step_work(half, 1, 1, 10, 10).bytes == weights / 2


def test_a_mixed_steps_phases_add_up_to_the_whole_step(tiny):
    """Two decodes (at 5 and 9 positions) beside a 4-token chunk after 3 cached positions that completes."""
    s = _shape(tiny)
    parts = phase_work(s, 2, (1, 1, 4), (5, 9, 3), 3)
    whole = step_work(s, 6, 3, 6 + 10 + chunk_pairs(3, 4), 5 + 9 + 3)
    assert parts["decode"].flops + parts["prefill"].flops == whole.flops
    assert abs(parts["decode"].bytes + parts["prefill"].bytes - whole.bytes) < 1e-6 * whole.bytes
    assert phase_work(s, 1, (1,), (5,), 1)["prefill"] == step_work(s, 0, 0, 0, 0)
