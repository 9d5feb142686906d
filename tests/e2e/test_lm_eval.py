"""lm-evaluation-harness against the server, as its users check a served model's accuracy: a
multiple-choice task (tests/fixtures/lm_eval, 50 items, read offline) through `local-completions`
with 4 prompts per request (`echo` + `logprobs` over token-id prompts), against lm-eval's own HF
backend on the same weights.

Float32 must agree with transformers: the same choice on every item, the same accuracy, each
loglikelihood within 1e-3.  The GGUF file's own (Q4_1) kernels are checked against the float32
server's loglikelihoods: the same weights, but activations quantized to 8 bits in the kernels.  Measured
on a 2-core AMD EPYC (Zen 3): |difference| median 0.19 nats, p90 0.56, max 0.89 (at most 13 % of the
loglikelihood); 47 of 50 choices the same, accuracy 0.66 vs 0.72.  Asserted: each within 15 % (at least
0.15 nats), at least 45 choices the same, accuracy within 0.1 — a broken kernel is off by whole nats.
"""

from __future__ import annotations

import os

import httpx
import pytest

from serving.model_files import prepare_model_dir
from tests.server_util import ServerProc

pytestmark = pytest.mark.smollm

TASK_DIR = "tests/fixtures/lm_eval"
TASK = "sightline_mc"


def _evaluate(model: str, model_args: str, batch_size: int = 4) -> dict[int, list[float]]:
    """Per item, each choice's loglikelihood; and the accuracy under key -1."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = TaskManager(include_path=TASK_DIR, include_defaults=False)  # indexing lm-eval's own tasks costs ~10 s
    res = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size, task_manager=tasks, log_samples=True
    )
    out = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in res["samples"][TASK]}
    out[-1] = [res["results"][TASK]["acc,none"]]
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


@pytest.fixture(scope="module")
def model_dir():
    path, _ = prepare_model_dir("smollm2-135m")
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    return _evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", batch_size=32)  # 4 took 2x as long


def _served(model_dir, tmp_path_factory, quantization: str, tokenizer_backend: str) -> dict[int, list[float]]:
    srv = ServerProc(
        "--quantization", quantization, model="smollm2-135m", tmpdir=tmp_path_factory.mktemp(f"lm-eval-{quantization}")
    )
    try:
        name = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        args = (
            f"base_url={srv.url}/v1/completions,model={name},tokenizer_backend={tokenizer_backend},"
            f"tokenizer={model_dir},tokenized_requests=True,num_concurrent=1,max_retries=1"
        )
        return _evaluate("local-completions", args)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def served_f32(model_dir, tmp_path_factory):
    # "auto": lm-eval probes /tokenizer_info and /tokenize and, finding them, tokenizes through the server
    return _served(model_dir, tmp_path_factory, "none", "auto")


def test_float32_matches_lm_evals_hf_backend(hf, served_f32):
    assert len(hf) == len(served_f32) == 51
    for doc, ref in hf.items():
        if doc < 0:
            continue
        got = served_f32[doc]
        assert got == pytest.approx(ref, abs=1e-3), doc
        assert _argmax(got) == _argmax(ref), doc
    assert served_f32[-1][0] == pytest.approx(hf[-1][0], abs=1e-6)
    assert hf[-1][0] > 0.5  # the task is one the model mostly gets right: a broken score would show


def test_gguf_kernels_track_the_float32_loglikelihoods(model_dir, tmp_path_factory, served_f32):
    q = _served(model_dir, tmp_path_factory, "gguf", "huggingface")
    same = 0
    for doc, ref in served_f32.items():
        if doc < 0:
            continue
        for got, want in zip(q[doc], ref):
            assert abs(got - want) <= 0.15 * max(1.0, abs(want)), doc
        same += _argmax(q[doc]) == _argmax(ref)
    assert same >= 45
    assert abs(q[-1][0] - served_f32[-1][0]) <= 0.1
