"""Owns the model forward and the KV pool; runs one ragged batch per call.

The forward is the registry's implementation for the loaded model's architecture.  An encoder
(BERT) runs each input whole in one step and keeps no K/V: its pool holds the slot bookkeeping
only (no layer storage), and its context is capped by the step's prefill budget and by the
directory's sentence-transformers `max_seq_length` too.
"""

from __future__ import annotations

import ctypes
import logging
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from serving import startup_phases
from serving.args import TEAM_SPIN_US, ServerArgs
from serving.engine.batch import Work, build_batch
from serving.engine.embedding import max_seq_length
from serving.engine.kv_pool import KVPool
from serving.engine.loader import LazyHFModel, LoadedModel
from serving.engine.precision import choose
from serving.models.base import CausalLM, ModelDims
from serving.models.gguf_weights import GGUFWeights
from serving.models.layers import native
from serving.models.layers.decode_attention import select as select_decode_attention
from serving.models.layers.extend_attention import extend_for
from serving.models.registry import family as family_of
from serving.models.safetensors_weights import SafetensorsWeights, weight_files

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, args: ServerArgs) -> None:
        torch.set_num_threads(args.threads)
        startup_phases.begin("native_kernels")
        lib = native.load(args.cache_dir_path)
        if lib is not None:  # before any kernel runs: the team's size and spin are fixed at its start
            spin = TEAM_SPIN_US[args.thread_wait_policy]
            team = native.start_team(lib, torch.get_num_threads(), spin, args.kernel_worker_nice)
            log.info(
                "native kernels: %d threads, idle workers spin %d µs at nice %d", team, spin, args.kernel_worker_nice
            )
        fam = family_of(loaded.hf_model.config)
        self.encoder = fam.encoder  # bidirectional: whole inputs per step, embeddings only, no K/V kept
        self.precision, why = choose(args, ModelDims.from_hf_config(loaded.hf_model.config), loaded.gguf is not None)
        wait = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ)
        log.info(
            "computing in %s, quantization %s (%s); %d threads, OpenMP wait: %s",
            self.precision.dtype,
            self.precision.quantization,
            why,
            torch.get_num_threads(),
            wait or "default",
        )
        startup_phases.begin("weight_load")
        self.model: CausalLM = self._build(fam.impl, loaded)
        if args.enforce_eager and getattr(self.model, "stack", None) is not None:
            self.model.stack = None
        stacked = getattr(self.model, "stack", None) is not None
        log.info(
            "decode-only steps: %s",
            "one native call for every layer"
            if stacked
            else "layer by layer (--enforce-eager)"
            if args.enforce_eager
            else "layer by layer (not every layer is on the native float32 or quantized kernels)",
        )
        self.decode_attention, why = select_decode_attention(args.attention_backend, args.cache_dir_path)
        self.extend_attention = extend_for(self.decode_attention)  # native beside the native decode kernel
        log.info("decode attention: %s", why)
        dims = self.model.dims
        self.window = dims.sliding_window
        if self.window:
            log.info("sliding-window attention: each token attends to its last %d positions", self.window)
        ctx = args.context_length or dims.max_positions
        # A request must fit in the pool on its own, or reservation could never admit it.
        self.context_len = min(ctx, dims.max_positions, args.max_total_tokens)
        if self.encoder:  # an input is never chunked: it must fit one step's prefill (and sentence-transformers' cap)
            self.context_len = min(
                self.context_len, args.max_prefill_tokens, max_seq_length(loaded.path) or self.context_len
            )
        self.vocab_size = dims.vocab_size
        self.hidden: torch.Tensor | None = None  # the latest step's pooled rows (embedding requests)
        self.scored: torch.Tensor | None = None  # the latest step's prompt-logprobs rows (`Work.score`), final-normed
        startup_phases.begin("kv_pool")
        self.pool = KVPool(
            0 if self.encoder else dims.num_layers,
            dims.num_kv_heads,
            dims.head_dim,
            args.max_total_tokens,
            args.max_running_requests,
            self.context_len,
            dtype=self.precision.torch_dtype,
        )  # the KV cache follows --dtype
        release_free_heap()

    def _build(self, family: type[CausalLM], loaded: LoadedModel) -> CausalLM:
        """The forward over the GGUF file's own tensors (`--quantization gguf`), else over the directory's
        safetensors, else over a transformers model already loaded."""
        if self.precision.quantization == "gguf":
            src = GGUFWeights(loaded.gguf, loaded.hf_model.config)
            model = family.from_weights(src, self.precision)
            src.release_pages()
            src.log_expanded()
            return model
        if isinstance(loaded.hf_model, LazyHFModel) and not loaded.hf_model.loaded and weight_files(loaded.path):
            files = SafetensorsWeights(loaded.path, loaded.hf_model.config)
            model = family.from_weights(files, self.precision)
            files.finish()
            return model
        return family.from_hf(loaded.hf_model, self.precision)

    def forward(self, decodes: list[Work], extends: list[Work]) -> torch.Tensor:
        """Allocate KV for every fed token, run the model, return logits of the rows that need them."""
        with self.step(decodes, extends) as logits:
            return logits

    @contextmanager
    def step(
        self, decodes: list[Work], extends: list[Work], hidden_rows: list[int] | None = None
    ) -> Iterator[torch.Tensor]:
        """`forward` whose KV allocation is undone if it, or the caller's block using its logits, raises.

        The K/V written for those positions stay in slots now free again: harmless, since a
        position counts only once the caller marks it computed.
        """
        fb = build_batch(decodes, extends, self.pool, self.window)
        fb.decode_attention, fb.extend_attention = self.decode_attention, self.extend_attention
        if hidden_rows:  # embedding requests' pooled rows: their hidden states are left in `self.hidden`
            fb.hidden_rows = torch.tensor(hidden_rows, dtype=torch.int64)
        self.hidden = self.scored = None
        try:
            with torch.inference_mode():
                logits = self.model.forward(fb, self.pool.kv)
                self.hidden, self.scored = fb.hidden, fb.scored
                yield logits
        except BaseException:
            self.pool.free(fb.out_slots)
            raise


def release_free_heap() -> None:
    """Hand the heap the build freed (repacking's and the loader's temporaries) back to the OS: glibc
    keeps freed memory below its trim threshold, which would stay resident for the server's life."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
