"""Shared fixtures: real models (tiny-random for speed, the bundled SmolLM2-135M where it matters)."""

from __future__ import annotations

import pytest
import torch

from serving.args import ServerArgs
from serving.engine.loader import LoadedModel, load_model
from protocol.sampling_params import SamplingParams
from serving.engine.scheduler_core import SchedulerCore
from tests.otlp_receiver import OTLPReceiver

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(params=["tiny", "smollm"])
def any_model(request) -> LoadedModel:
    return request.getfixturevalue(request.param)


def encode(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer(text)["input_ids"]


def make_core(model: LoadedModel, **kw) -> SchedulerCore:
    """An in-process engine, exact (float32) unless the test asks for another precision."""
    return SchedulerCore(model, ServerArgs(model=model.name, **{"dtype": "float32", **kw}))


def greedy(n: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def collect(core: SchedulerCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step to idle; returns each rid's output token ids (aborted rids included)."""
    out: dict[str, list[int]] = {}
    for ev in core.run_to_completion(max_steps):
        out.setdefault(ev.rid, []).extend(ev.new_token_ids)
    return out


def hf_greedy(model: LoadedModel, ids: list[int], n: int = 32) -> list[int]:
    """transformers' own generate, one request at a time: the reference."""
    with torch.inference_mode():
        out = model.hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=model.tokenizer.eos_token_id,
        )
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """One real server (three processes, ZMQ, HTTP) on tiny-random, shared by the API tests."""
    from tests.server_util import ServerProc

    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("tiny-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory):
    """One real tiny-random server with an API key (`tests.server_util.TEST_KEY`), shared by the
    modules that test what the key protects (auth, /debug/profile, /debug/ui)."""
    from tests.server_util import TEST_KEY, ServerProc

    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("keyed-server"), env={"SIGHTLINE_API_KEY": TEST_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny-random server of the module's own, for tests whose counts must not see other modules' traffic."""
    from tests.server_util import ServerProc

    srv = ServerProc(tmpdir=tmp_path_factory.mktemp("server"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def otlp():
    """A real OTLP receiver (HTTP), one per test module."""
    r = OTLPReceiver()
    yield r
    r.close()
