"""bench.speculative_peers without servers: llama-server's one-stream command, each server's draft counters
read from its /metrics text, and the summary that picks llama.cpp's best arm per workload."""

from __future__ import annotations

from pathlib import Path

from bench import speculative_peers as sp
from bench.peers import llama_server_command
from bench.speculative import WORKLOADS, speculative_peers_lines


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_stream_llama_server_gets_the_bench_threads_and_one_slot():
    argv = llama_server_command(Path("/b"), 8000, 2048, "F32", threads=1, slots=1)
    assert _flag(argv, "-t") == _flag(argv, "-tb") == "1"
    assert _flag(argv, "-np") == "1" and _flag(argv, "-c") == "2048"
    assert all("--spec-type" == flags[0] for name, flags in sp.LLAMA_SPEC.items() if name != "none")


def test_draft_counters_sum_each_servers_own_counters(monkeypatch):
    pages = {
        "sightline": (
            'sightline_speculative_proposed_tokens_total{method="ngram"} 40.0\n'
            'sightline_speculative_accepted_tokens_total{method="ngram"} 30.0\n'
        ),
        "llama-server": (
            "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter\n"
            "llamacpp:spec_decode_num_draft_tokens_total 12\n"
            "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter\n"
            "llamacpp:spec_decode_num_accepted_tokens_total 3\n"
        ),
    }

    class Page:
        def __init__(self, text: str) -> None:
            self.text = text

    for server, want in (("sightline", (40.0, 30.0)), ("llama-server", (12.0, 3.0))):
        monkeypatch.setattr(sp.httpx, "get", lambda url, timeout, s=server: Page(pages[s]))
        assert sp.draft_counters("http://x", server) == want


def test_the_summary_compares_each_server_with_its_own_off_and_ours_with_llamas_best():
    arms = [
        sp.Arm("sightline", "off", []),
        sp.Arm("sightline", "ngram", []),
        sp.Arm("llama-server", "none", []),
        sp.Arm("llama-server", "ngram-cache", []),
    ]
    rates = {"sightline off": 50, "sightline ngram": 100, "llama-server none": 40, "llama-server ngram-cache": 80}
    for arm in arms:
        for wl in WORKLOADS:
            fast = wl != "free_text" or arm.setting in ("off", "none")
            arm.rates[wl] = [rates[arm.name] * (1 if fast else 0.5)] * 3
            arm.ttft[wl], arm.tokens[wl] = [10.0] * 3, [64] * 3
            arm.drafts[wl] = [20.0, 15.0] if arm.speculates else [0.0, 0.0]
    out = sp.summarise(arms)
    code = out["code_edit"]
    assert code["arms"]["sightline ngram"]["speedup"] == code["arms"]["llama-server ngram-cache"]["speedup"] == 2
    assert code["llama_best"] == "llama-server ngram-cache" and code["sightline_over_llama_best"] == 1.25
    assert code["arms"]["sightline ngram"]["acceptance"] == 0.75 and code["arms"]["sightline off"]["acceptance"] is None
    free = out["free_text"]  # speculation slower there: llama's best is its own "none"
    assert free["llama_best"] == "llama-server none" and free["sightline_over_llama_best"] == 1.25
    doc = {"threads": 1, "gen_len": 64, "rounds": 3, "workloads": out, "llama_command": "llama-server -t 1"}
    lines = speculative_peers_lines(doc)
    assert "| code_edit (copy) | sightline | ngram | 100.0 [100.0-100.0] | 2.00× | 75 % | 64 | 10 |" in lines
    assert "code_edit: sightline ngram ÷ llama-server's best (llama-server ngram-cache): 1.25×" in lines
