"""Owns the model forward and the KV pool; runs one ragged batch per call."""

from __future__ import annotations

import torch

from serving.args import ServerArgs
from serving.engine.batch import Work, build_batch
from serving.engine.kv_pool import KVPool
from serving.engine.loader import LoadedModel
from serving.models.llama import LlamaForward


class ModelRunner:
    def __init__(self, loaded: LoadedModel, args: ServerArgs) -> None:
        torch.set_num_threads(args.threads)
        self.model = LlamaForward.from_hf(loaded.hf_model)
        dims = self.model.dims
        ctx = args.context_length or dims.max_positions
        # A request must fit in the pool on its own, or reservation could never admit it.
        self.context_len = min(ctx, dims.max_positions, args.max_total_tokens)
        self.vocab_size = dims.vocab_size
        self.pool: KVPool = self.model.make_kv_pool(args.max_total_tokens, args.max_running_requests, self.context_len)

    def forward(self, decodes: list[Work], extends: list[Work]) -> torch.Tensor:
        """Allocate KV for every fed token, run the model, return logits of the rows that need them."""
        fb = build_batch(decodes, extends, self.pool)
        with torch.inference_mode():
            return self.model.forward(fb, self.pool)
