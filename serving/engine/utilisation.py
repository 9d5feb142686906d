"""What one engine step asks of the machine, counted analytically: FLOPs and bytes moved.

A decoder layer's work is fixed by the model's shape, so it is counted from the config and
the batch's shape rather than measured: against the machine's measured peak it says whether a
slow step is the box (near its peak compute or bandwidth) or the code (far below both).

* FLOPs: 2 per weight per token in every linear layer (q, k, v, o, gate, up, down), the
  LM head for each token that is sampled, and attention's two matrix products (scores and
  the weighted values: 4 · heads · head_dim per token per attended position, per layer).
* Bytes: every weight read once per step at its stored width, each request's K/V read once
  per step over the positions it attends to, the new tokens' K/V written, and each linear
  layer's activations read and written at the compute width.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes per weight of each quantization as stored (blocks' scales included); `gguf` serves a file's own mix of
# types, counted as Q4_K's (the usual Q4_K_M file is mostly Q4_K)
WEIGHT_BYTES = {
    "int8": 1.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
    "q4_k": 144 / 256,
    "gguf": 144 / 256,
}


@dataclass(frozen=True)
class ModelShape:
    """The numbers the count needs, from the model's config and its precision."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: float = 4.0  # bytes per weight as stored (4 float32, 2 bfloat16, 1 int8, ~0.56 q4_k)
    kv_bytes: int = 4  # bytes per K/V element
    act_bytes: int = 4  # bytes per activation element

    @classmethod
    def from_hf_config(cls, cfg, weight_bytes: float = 4.0, kv_bytes: int = 4, act_bytes: int = 4) -> "ModelShape":
        heads = cfg.num_attention_heads
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            cfg.vocab_size,
            weight_bytes,
            kv_bytes,
            act_bytes,
        )

    def linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate
        return (h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)

    @classmethod
    def served(cls, cfg, dtype: str, quantization: str) -> "ModelShape":
        """The shape of a model as the engine serves it: weights at their stored width (`WEIGHT_BYTES`), the KV
        cache and activations at the compute dtype."""
        width = DTYPE_BYTES.get(dtype, 4)
        return cls.from_hf_config(cfg, WEIGHT_BYTES.get(quantization, width), width, width)

    @property
    def layer_params(self) -> int:
        return sum(a * b for a, b in self.linears())

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden


@dataclass(frozen=True)
class StepWork:
    flops: float
    bytes: float


def step_work(shape: ModelShape, tokens: int, sampled: int, attended: int, contexts: int) -> StepWork:
    """One step's work: `tokens` fed (decodes + prefill chunk tokens), `sampled` of them through the LM head,
    `attended` (token, position) pairs attention scores over, `contexts` K/V positions read (each request's
    context once)."""
    if not tokens:
        return StepWork(0.0, 0.0)
    s, layers = shape, shape.num_layers
    flops = (
        2.0 * s.layer_params * layers * tokens
        + 2.0 * s.head_params * sampled
        + 4.0 * s.num_heads * s.head_dim * attended * layers
    )
    kv_row = 2 * s.num_kv_heads * s.head_dim * s.kv_bytes * layers  # one position's K and V, every layer
    act = sum(a + b for a, b in s.linears()) * s.act_bytes * layers * tokens + 2 * s.hidden * s.act_bytes * sampled
    moved = (s.layer_params * layers + s.head_params) * s.weight_bytes + kv_row * (contexts + tokens) + act
    return StepWork(flops, float(moved))


def chunk_pairs(start: int, length: int) -> int:
    """(token, position) pairs of a causal chunk of `length` tokens after `start` cached positions."""
    return length * start + length * (length + 1) // 2


def phase_work(
    shape: ModelShape, num_decode: int, tokens: tuple[int, ...], starts: tuple[int, ...], sampled: int
) -> dict[str, StepWork]:
    """One step's work by phase: its first `num_decode` requests decode (one token each, or `tokens[i]` rows when
    a speculative draft is verified, every row through the LM head), the rest run prefill chunks of `tokens[i]`
    tokens after `starts[i]` cached positions; `sampled` requests got tokens (the decodes and the prefills that
    completed). The weights, read once a step, are shared between the two phases by their
    tokens, so the phases add up to the whole step."""
    dec_tokens = sum(tokens[:num_decode])
    dec_pairs = sum(chunk_pairs(s, n) for s, n in zip(starts[:num_decode], tokens[:num_decode]))
    pre_tokens = sum(tokens[num_decode:])
    pre_pairs = sum(chunk_pairs(s, n) for s, n in zip(starts[num_decode:], tokens[num_decode:]))
    parts = {
        "decode": step_work(shape, dec_tokens, dec_tokens, dec_pairs, sum(starts[:num_decode])),
        "prefill": step_work(shape, pre_tokens, max(0, sampled - num_decode), pre_pairs, sum(starts[num_decode:])),
    }
    total = dec_tokens + pre_tokens
    weights = (shape.layer_params * shape.num_layers + shape.head_params) * shape.weight_bytes
    return {
        phase: StepWork(w.flops, w.bytes - weights + weights * n / total) if n else w
        for (phase, w), n in zip(parts.items(), (dec_tokens, pre_tokens))
    }
