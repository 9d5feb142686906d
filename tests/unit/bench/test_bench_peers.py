"""make bench's peer comparison, without servers: the request each server gets, how chunks are
read, the arguments, and the combined table."""

from __future__ import annotations

import json

import pytest

from bench.common import _chunk_text, completion_body, summary
from bench.peers import PEER_NAMES, make_peers, parse_args
from bench.table import render


def test_every_server_gets_the_same_request_but_its_own_way_to_ignore_eos():
    peers = {p.name: p for p in make_peers()}
    assert set(peers) == set(PEER_NAMES)
    ours = completion_body([1, 2, 3], 32)
    assert ours["ignore_eos"] is True
    common = {"max_tokens": 32, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    for p in peers.values():
        body = completion_body("some text", 32, extra=p.ignore_eos(32))
        assert {k: body[k] for k in common} == common and body["prompt"] == "some text"
        assert "ignore_eos" not in body  # transformers serve answers 422 to a field it does not know
    gen = json.loads(completion_body("x", 32, extra=peers["transformers"].ignore_eos(32))["generation_config"])
    assert gen == {"max_new_tokens": 32, "do_sample": False}  # no eos_token_id: never stops early
    llama = completion_body("x", 32, extra=peers["llama-cpp"].ignore_eos(32))
    assert (llama["min_tokens"], llama["repeat_penalty"]) == (32, 1.0)


def test_only_chunks_with_text_count_as_token_arrivals():
    assert _chunk_text({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}) == "ab"
    assert _chunk_text({"choices": [{"index": 0, "delta": {"content": "c"}}]}) == "c"
    assert _chunk_text({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {}}) == ""
    assert _chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_arguments():
    a = parse_args(["--concurrency", "1,16", "--gen-len", "32", "--peers", "llama-cpp"])
    assert (a.levels, a.gen_len, a.peer_names, a.skip_peers) == ([1, 16], 32, ["llama-cpp"], False)
    assert parse_args(["--skip-peers"]).peer_names == list(PEER_NAMES)
    with pytest.raises(SystemExit):
        parse_args(["--peers", "vllm"])


def level(ttft: list[float], itl: list[float], tok_s: float) -> dict:
    return {"ttft": ttft, "itl": itl, "tok_s": tok_s, "wall": 2.0}


def test_summary_and_one_table_for_ours_and_the_peers():
    s = summary(level([10.0, 30.0, 20.0], [5.0] * 99 + [50.0], 12.5))
    assert (s["ttft_p50_ms"], s["ttft_max_ms"], s["itl_p50_ms"], s["itl_p99_ms"]) == (20.0, 30.0, 5.0, 50.0)
    engine = {"prompt_len": 128, "gen_len": 32,
              "rows": [{"mode": "int8", "concurrency": 16, "out_tok_s": 99.04}]}
    http = {"prompt_len": 128, "gen_len": 32, "server_args": [],
            "engine_info": {"dtype": "bfloat16", "quantization": "none"},
            "levels": {"1": {"engine": level([1.0], [], 20.0), "http": level([40.0], [50.0, 52.0], 18.26)}}}
    peers = {"prompt_len": 128, "gen_len": 32, "peers": {
        "transformers": {"label": "transformers serve", "precision": "float32",
                         "levels": {"16": level([300.0], [80.0], 61.0)}},
        "llama-cpp": {"label": "llama-cpp-python server", "precision": "GGUF Q4_1", "skipped": "no compiler"}}}
    lines = render(engine, [http], peers).splitlines()
    assert lines[0].startswith("| server | precision | concurrency | output tok/s | TTFT p50 ms")
    assert "| sightline engine, in-process | int8 | 16 | 99.0 | – | – | – |" in lines
    assert "| sightline HTTP | bfloat16 | 1 | 18.3 | 40 | 52.0 | 52.0 |" in lines  # p50 of 2 gaps: the upper one
    assert "| transformers serve | float32 | 16 | 61.0 | 300 | 80.0 | 80.0 |" in lines
    assert "llama-cpp: skipped: no compiler" in lines
    assert render(None, [], None).splitlines()[:2] == lines[:2]
