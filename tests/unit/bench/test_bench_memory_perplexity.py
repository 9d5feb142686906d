"""bench.memory's KV-pool figure is the engine's own pool, its RSS reader reads /proc; bench.perplexity
cuts and scores chunks as llama-perplexity does (BOS first in each chunk where the file adds one)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bench.memory import kv_pool_mib, rss_mib
from bench.perplexity import chunks
from serving.args import ServerArgs
from serving.engine.loader import load_model
from serving.engine.model_runner import ModelRunner


def test_kv_pool_figure_is_the_engines_pool():
    model = load_model("tiny-random")
    runner = ModelRunner(model, ServerArgs(model=model.name, max_total_tokens=1000, dtype="float32"))
    kv = runner.pool.kv
    tensors = [t for t in vars(kv).values() if isinstance(t, torch.Tensor)]
    tensors += [t for v in vars(kv).values() if isinstance(v, (list, tuple)) for t in v if isinstance(t, torch.Tensor)]
    pool = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    assert pool > 0 and math.isclose(kv_pool_mib(model.path, 1000, 4), pool, rel_tol=1e-6)


def test_rss_is_read_from_proc_status():
    got = rss_mib(Path("/proc/self/status").read_text())
    assert set(got) == {"VmRSS", "RssAnon", "RssFile"} and got["VmRSS"] >= got["RssAnon"] > 10


def test_chunks_are_llama_perplexitys():
    tokens = list(range(1000))
    cut = chunks(tokens, 256, 12, bos=None)
    assert len(cut) == 3 and cut[1] == list(range(256, 512))  # whole chunks only, at most --chunks
    with_bos = chunks(tokens, 256, 2, bos=7)
    assert len(with_bos) == 2 and with_bos[1][0] == 7 and with_bos[1][1:] == list(range(257, 512))
