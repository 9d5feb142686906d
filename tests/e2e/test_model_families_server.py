"""Each registered family through the whole HTTP stack, served from a GGUF file written the
way llama.cpp writes one (converted once by the main process, loaded by the Scheduler):
`/v1/models` says what runs, and a greedy completion equals the in-process engine's on the
family's HF directory.  A model that cannot be served stops the server with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loadtest.server import REPO, free_port
from serving.engine.loader import load_model
from serving.models.layers import native_quant
from tests.family_models import FAMILIES, SLIDING_WINDOW, build, gguf
from tests.helpers import collect, greedy, make_core
from tests.server_util import ServerProc

PROMPT = (
    "The lighthouse keeper climbed the stairs every evening, counting each step, "
    "and at the top he lit the lamp that guided the ships home"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per family, started side by side (their start-up is mostly imports)."""
    # the GGUFs are converted once, in the default cache (`make setup`), and found there; paths
    # and tmp dirs are made here, not in the threads (neither transformers' lazy imports nor pytest's
    # tmp_path_factory are thread-safe)
    paths = {f: gguf(f) for f in FAMILIES}
    dirs = {f: tmp_path_factory.mktemp(f) for f in FAMILIES}

    def start(family: str) -> ServerProc:
        return ServerProc("--num-threads", "1", model=str(paths[family]), tmpdir=dirs[family])

    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        futures = {f: pool.submit(start, f) for f in FAMILIES}
    started = {f: fut.result() for f, fut in futures.items() if fut.exception() is None}
    try:
        for fut in futures.values():
            if fut.exception() is not None:
                raise fut.exception()
        yield started
    finally:
        with ThreadPoolExecutor(len(FAMILIES)) as pool:
            list(pool.map(lambda srv: srv.stop(), started.values()))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_serves_over_http_from_gguf(servers, family):
    model = load_model(str(build(family)))
    ids = model.tokenizer(PROMPT)["input_ids"]
    core = make_core(model, disable_prefix_cache=True)
    core.add_request("ref", ids, greedy(16, ignore_eos=True))
    expected = model.tokenizer.decode(collect(core)["ref"])

    srv = servers[family]
    card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == gguf(family).name and card["architecture"] == model.architecture
    assert card["max_model_len"] == core.context_len  # the model's, capped by the default --max-total-tokens
    # auto: a GGUF in its own types where the interleaved kernel runs, else expanded (docs/engine.md)
    own = native_quant.load().interleaves
    assert (card["dtype"], card["quantization"]) == ("float32", "gguf" if own else "none")
    assert card["sliding_window"] == SLIDING_WINDOW.get(family)
    body = {"model": card["id"], "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    out = srv.post("/v1/completions", body).json()
    assert out["choices"][0]["text"] == expected
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 16


def test_a_model_that_cannot_be_served_stops_the_server_with_one_line(tmp_path):
    bad = tmp_path / "qwen2-bad"
    shutil.copytree(build("qwen2"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving",
            "serve",
            "--model",
            str(bad),
            "--port",
            str(free_port()),
            "--log-format",
            "text",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: hidden_act 'gelu' is not supported: the gated MLP computes SiLU"], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "could not load the model" in proc.stderr
