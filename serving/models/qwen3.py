"""The Qwen3 family: the Llama-shaped decoder with an RMSNorm over each head of Q and K before RoPE.

Its attention has no biases (unlike Qwen2) and its `head_dim` is set independently of
`hidden_size / num_attention_heads`; both already come from the config and the weights.
"""

from __future__ import annotations

from serving.models.llama import LlamaForward


class Qwen3Forward(LlamaForward):
    QK_NORM = True
