"""What tests share besides fixtures: the repository's paths, prompts, an in-process engine and
its greedy runs, transformers' reference generation, the committed dashboards.  Fixtures stay
in `conftest.py`; support servers and writers have modules of their own (`server_util`,
`prom_util`, `otlp_receiver`, `gguf_writer`, `family_models`)."""

from __future__ import annotations

import importlib.util
import json
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from dashboards import lint
from dashboards.generate import DASHBOARD_DIR
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.engine.batch import Work
from serving.engine.loader import LoadedModel
from serving.engine.scheduler_core import SchedulerCore

REPO = Path(__file__).resolve().parent.parent  # the checkout
FIXTURES = REPO / "tests" / "fixtures"

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
]


def script_module(name: str) -> ModuleType:
    """A script of `scripts/` (not a package) loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encode(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer(text)["input_ids"]


def make_core(model: LoadedModel, **kw) -> SchedulerCore:
    """An in-process engine, exact (float32, a GGUF's weights expanded) unless the test asks for another precision."""
    return SchedulerCore(model, ServerArgs(model=model.name, **{"dtype": "float32", "quantization": "none", **kw}))


def greedy(n: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def collect(core: SchedulerCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step to idle; returns each rid's output token ids (aborted rids included)."""
    out: dict[str, list[int]] = {}
    for ev in core.run_to_completion(max_steps):
        out.setdefault(ev.rid, []).extend(ev.new_token_ids)
    return out


def run_requests(core: SchedulerCore, requests, check: bool = True) -> dict[str, list[int]]:
    """Queue `requests` ((rid, input ids, params)), step to idle checking the KV bookkeeping after every step
    (`check`); each rid's output token ids.  The pool is idle after."""
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
    outs: dict[str, list[int]] = {}
    while core.has_work:
        for ev in core.step():
            outs.setdefault(ev.rid, []).extend(ev.new_token_ids)
        if check:
            core.check_kv_invariants()
    assert core.pool.is_idle()
    return outs


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while it lasts, for transformers' reference runs: beside the other test lane
    on 2 cores, torch's two OpenMP threads wait for each other at every op (a SmolLM2 forward ~2 s
    against ~0.4 s on one thread; alone on the machine the two take about the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hf_greedy(model: LoadedModel, ids: list[int], n: int = 32) -> list[int]:
    """transformers' own generate, one request at a time: the reference."""
    with torch.inference_mode():
        out = model.hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=model.tokenizer.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def decode_argmax(runner, rows: list, seqs: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """One batched decode step through a ModelRunner: each row takes its argmax token (appended to its
    sequence); the step's logits."""
    work = []
    for r, s, t in zip(rows, seqs, logits.argmax(-1).tolist()):
        work.append(Work(r, len(s), [t], True))
        s.append(t)
    return runner.forward(work, [])


def boards() -> dict[str, dict]:
    """The committed Grafana dashboards by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((REPO / "dashboards" / DASHBOARD_DIR).glob("*.json"))}


def exprs(board: dict) -> list[str]:
    """Every PromQL expression of a dashboard's panels."""
    return [t["expr"] for p in lint.panels(board) for t in p["targets"]]


def chi2_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test (df = bins - 1)."""
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2.0), stat / 2))


def assert_distributed_as(observed: torch.Tensor, p: torch.Tensor, alpha: float = 0.001, least: int = 500) -> None:
    """Token counts `observed` [V] (at least `least` of them) pass a chi-square test against the distribution
    `p` [V]: a bin per token expected at least 5 times, the rest pooled into one."""
    total = observed.sum()
    keep = torch.nonzero(p * total >= 5.0).flatten()
    exp = torch.cat([p[keep] * total, (1 - p[keep].sum()).clamp(min=0).reshape(1) * total])
    obs = torch.cat([observed[keep], (total - observed[keep].sum()).reshape(1)])
    if exp[-1] < 5:  # nothing worth a bin outside the kept tokens
        exp, obs = exp[:-1], obs[:-1]
    assert len(obs) >= 3 and total >= least, (len(keep), float(total), float(p.max()))
    assert chi2_p(obs, exp) > alpha, (obs, exp)
