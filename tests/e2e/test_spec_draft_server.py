"""Draft-model speculation through one real server (`--speculative draft --speculative-model`) on the seeded
Llama pair (`tests.family_models.draft_pair`): the same tokens speculated and opted out, what each request says
it proposed and accepted agrees with /debug/requests and the metrics under `method="draft"`, a seeded sampled
request reproduces, and flags that do not fit stop the server at startup with one clear line."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.family_models import draft_pair
from tests.server_util import ServerProc, scrape, value

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def models() -> tuple[str, str]:
    target, draft = draft_pair()
    return str(target), str(draft)


@pytest.fixture(scope="module")
def srv(models, tmp_path_factory):
    target, draft = models
    s = ServerProc(
        "--speculative", "draft", "--speculative-model", draft, model=target, tmpdir=tmp_path_factory.mktemp("draft")
    )
    yield s
    s.stop()


def _generate(srv: ServerProc, **params) -> dict:
    sp = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True, **params}
    r = srv.post("/generate", {"text": PROMPT, "sampling_params": sp})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def runs(srv):
    return {"on": _generate(srv), "off": _generate(srv, speculative=False)}


def test_greedy_tokens_are_the_same_with_the_draft_and_its_drafts_land(runs):
    on, off = runs["on"], runs["off"]
    assert on["output_ids"] == off["output_ids"] and len(on["output_ids"]) == 32 and on["text"] == off["text"]
    spec = on["meta_info"]["sightline"]["speculative"]
    assert 0 < spec["accepted"] < spec["proposed"] and spec["rejected"] == spec["proposed"] - spec["accepted"]
    assert spec["accepted"] + spec["steps"] == 32 and spec["steps"] < 32
    assert "speculative" not in off["meta_info"]["sightline"]


def test_a_seeded_sampled_request_reproduces(srv):
    first, again = (_generate(srv, temperature=0.8, seed=7, max_new_tokens=16) for _ in range(2))
    assert first["output_ids"] == again["output_ids"] and len(first["output_ids"]) == 16
    assert first["meta_info"]["sightline"]["speculative"]["proposed"] > 0


def test_debug_requests_and_metrics_count_the_draft_method(srv, runs):
    srv.barrier()
    entries = httpx.get(srv.url + "/debug/requests", timeout=10).json()["requests"]
    speculated = [e["speculative"] for e in entries if "speculative" in e]
    assert runs["on"]["meta_info"]["sightline"]["speculative"] in speculated
    text = scrape(srv)
    proposed = value(text, "sightline_speculative_proposed_tokens_total", method="draft")
    accepted = value(text, "sightline_speculative_accepted_tokens_total", method="draft")
    assert proposed == sum(s["proposed"] for s in speculated) and accepted == sum(s["accepted"] for s in speculated)
    assert 0 < accepted < proposed
    assert value(text, "sightline_speculative_proposed_tokens_total", method="ngram") == 0
    assert value(text, "sightline_speculative_acceptance_rate_count", method="draft") == len(speculated)
    assert value(text, "sightline_speculative_step_tokens_count", method="draft") > 0
    assert value(text, "sightline_startup_phase_seconds", phase="draft_model") > 0  # the draft's load, its own phase


def _refused(model: str, *flags: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "serving", "serve", "--model", model, *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    return p.stderr


def test_flags_that_do_not_fit_fail_at_startup(models):
    """The pair's own checks (tokenizer, size) are the engine's (tests/unit/serving/engine/test_spec_draft.py):
    a server start that refuses one prints the same single `error:` line as any model that cannot load."""
    together = "--speculative draft and --speculative-model go together"
    assert together in _refused("tiny-random", "--speculative", "draft")
    assert together in _refused("tiny-random", "--speculative", "ngram", "--speculative-model", models[1])
