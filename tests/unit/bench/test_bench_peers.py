"""make bench's peer comparison, without building llama.cpp or starting servers: the request
each server gets, how chunks are read, llama-server's command line and build stamp, the
arguments, and the combined table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import peers as peers_mod
from bench.common import _chunk_text, completion_body, summary
from bench.peers import GGUF_TYPES, PEER_NAMES, SLOTS, make_peers, parse_args, pp_summary
from bench.table import render


def test_every_server_gets_the_same_request_but_its_own_way_to_ignore_eos():
    peers = {p.name: p for p in make_peers()}
    assert set(peers) == set(PEER_NAMES) == {"transformers", *(f"llama-server-{t}" for t in GGUF_TYPES)}
    ours = completion_body([1, 2, 3], 32)
    assert ours["ignore_eos"] is True
    common = {"max_tokens": 32, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    for p in peers.values():
        body = completion_body("some text", 32, extra=p.ignore_eos(32))
        assert {k: body[k] for k in common} == common and body["prompt"] == "some text"
    tf = completion_body("x", 32, extra=peers["transformers"].ignore_eos(32))
    assert "ignore_eos" not in tf  # transformers serve answers 422 to a field it does not know
    assert json.loads(tf["generation_config"]) == {"max_new_tokens": 32, "do_sample": False}  # no eos_token_id
    for t in GGUF_TYPES:
        assert completion_body("x", 32, extra=peers[f"llama-server-{t}"].ignore_eos(32))["ignore_eos"] is True


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_llama_server_binds_loopback_and_batches_64_slots_over_every_core(monkeypatch):
    monkeypatch.setattr(peers_mod, "bundled_gguf_path", lambda: Path("/wheel/SmolLM2.Q4_1.gguf"))
    monkeypatch.setattr(peers_mod.os, "cpu_count", lambda: 2)
    peers = {p.name: p for p in make_peers()}
    for t in GGUF_TYPES:
        p = peers[f"llama-server-{t}"]
        argv = p.command(Path("/b/bin"), 8123, 768)
        assert argv[0] == "/b/bin/llama-server"
        assert _flag(argv, "--host") == "127.0.0.1" and argv.count("--host") == 1
        assert _flag(argv, "--port") == "8123"
        assert _flag(argv, "-np") == str(SLOTS) == "64" and "--cont-batching" in argv
        assert _flag(argv, "-t") == _flag(argv, "-tb") == "2"
        assert _flag(argv, "-c") == str(64 * 768)  # every slot holds a whole request
        model = Path(_flag(argv, "-m"))
        assert model == (Path("/wheel/SmolLM2.Q4_1.gguf") if t == "Q4_1" else peers_mod.gguf_path(t))
        assert model.is_relative_to(peers_mod.REPO / "results") or t == "Q4_1"  # nothing of llama.cpp outside
        assert (p.pair, p.precision.split()[:2]) == ("float32" if t == "F32" else f"GGUF {t}", ["GGUF", t])
        if t != "F32":  # ours runs on the very file the peer serves, in its own types
            assert peers_mod.our_run(p.pair) == (str(model), [])


def test_the_build_is_redone_when_the_version_or_the_cpu_changes(monkeypatch):
    stamp = peers_mod.build_stamp()
    assert peers_mod.LLAMA_CPP_VERSION in stamp and "-DGGML_NATIVE=ON" in stamp and "cpu " in stamp
    monkeypatch.setattr(peers_mod, "cpu_flags", lambda: "another CPU")
    assert peers_mod.build_stamp() != stamp
    monkeypatch.setattr(peers_mod, "LLAMA_CPP_VERSION", "9.9.9")
    assert "9.9.9" in peers_mod.build_stamp() and "9.9.9" in str(peers_mod.llama_tree())


def test_only_chunks_with_text_count_as_token_arrivals():
    assert _chunk_text({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}) == "ab"
    assert _chunk_text({"choices": [{"index": 0, "delta": {"content": "c"}}]}) == "c"
    assert _chunk_text({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {}}) == ""
    assert _chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_arguments():
    a = parse_args(["--concurrency", "1,16", "--gen-len", "32", "--peers", "llama-server-Q8_0"])
    assert (a.levels, a.gen_len, a.peer_names, a.skip_peers, a.pp_len) == (
        [1, 16],
        32,
        ["llama-server-Q8_0"],
        False,
        512,
    )
    assert parse_args(["--peers", "llama-server"]).peer_names == [f"llama-server-{t}" for t in GGUF_TYPES]
    assert parse_args(["--skip-peers"]).peer_names == list(PEER_NAMES)
    for bad in (["--peers", "vllm"], ["--peers", "llama-cpp"], ["--concurrency", "1,128"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def level(ttft: list[float], itl: list[float], tok_s: float) -> dict:
    return {"ttft": ttft, "itl": itl, "tok_s": tok_s, "wall": 2.0}


def _http(flags: list[str], info: dict, levels: dict, model: str = "smollm2-135m") -> dict:
    return {
        "model": model,
        "prompt_len": 128,
        "gen_len": 32,
        "server_args": flags,
        "engine_info": info,
        "levels": levels,
    }


def test_pp_is_prompt_tokens_over_the_median_ttft():
    assert pp_summary([400.0, 250.0, 260.0], 512) == {
        "prompt_tokens": 512,
        "ttft": [400.0, 250.0, 260.0],
        "ttft_p50_ms": 260.0,
        "tok_s": pytest.approx(1969.2, 0.01),
    }


def test_one_table_puts_each_precision_pair_side_by_side():
    s = summary(level([10.0, 30.0, 20.0], [5.0] * 99 + [50.0], 12.5))
    assert (s["ttft_p50_ms"], s["ttft_max_ms"], s["itl_p50_ms"], s["itl_p99_ms"]) == (20.0, 30.0, 5.0, 50.0)
    engine = {
        "prompt_len": 128,
        "gen_len": 32,
        "rows": [
            {"mode": "int8", "concurrency": 16, "out_tok_s": 99.04},
            {"mode": "gguf", "concurrency": 16, "out_tok_s": 120.0},
        ],
    }
    f32 = _http(
        ["--dtype=float32"],
        {"dtype": "float32", "quantization": "none"},
        {
            "1": {"engine": level([1.0], [], 20.0), "http": level([40.0], [50.0, 52.0], 10.0)},
            "16": {"http": level([400.0], [60.0], 40.0)},
        },
    )
    int8 = _http(
        ["--quantization=int8"],
        {"dtype": "bfloat16", "quantization": "int8"},
        {"16": {"http": level([300.0], [30.0], 50.0)}},
    )
    q8 = _http(
        [],
        {"dtype": "float32", "quantization": "gguf"},
        {"16": {"http": level([300.0], [30.0], 90.0)}},
        model="/r/gguf-0.3.36/SmolLM2-135M-Instruct-Q8_0.gguf",
    )
    q41 = _http(
        [],
        {"dtype": "float32", "quantization": "gguf"},
        {"16": {"http": level([200.0], [25.0], 60.0)}},
        model="/wheel/SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    peers = {
        "prompt_len": 128,
        "gen_len": 32,
        "pp_len": 512,
        "cpus": 2,
        "peers": {
            "transformers": {
                "label": "transformers serve",
                "precision": "float32",
                "pair": "float32",
                "levels": {"16": level([300.0], [80.0], 20.0)},
            },
            "llama-server-F32": {
                "label": "llama-server",
                "precision": "GGUF F32",
                "pair": "float32",
                "command": "/x/bin/llama-server -m /y/m-F32.gguf --host 127.0.0.1 -np 64",
                "levels": {"1": level([30.0], [20.0], 25.0), "16": level([200.0], [40.0], 80.0)},
                "pp": {"tok_s": 1024.0, "ttft_p50_ms": 500.0, "ttft": [500.0]},
            },
            "llama-server-Q8_0": {
                "label": "llama-server",
                "precision": "GGUF Q8_0",
                "pair": "GGUF Q8_0",
                "levels": {"16": level([100.0], [20.0], 100.0)},
            },
            "llama-server-Q4_K_M": {
                "label": "llama-server",
                "precision": "GGUF Q4_K_M",
                "pair": "GGUF Q4_K_M",
                "skipped": "its server exited with 1 on startup",
            },
            "llama-server-Q4_1": {
                "label": "llama-server",
                "precision": "GGUF Q4_1 (bundled)",
                "pair": "GGUF Q4_1",
                "levels": {"16": level([100.0], [20.0], 45.0)},
            },
        },
        "sightline_pp": {
            "float32": {"server_args": ["--dtype=float32"], "tok_s": 512.0, "ttft_p50_ms": 1000.0, "ttft": [1000.0]},
            "GGUF Q8_0": {
                "server_args": [],
                "model": "/r/gguf-0.3.36/SmolLM2-135M-Instruct-Q8_0.gguf",
                "skipped": "no port",
            },
        },
    }
    lines = render(engine, [f32, int8, q8, q41], peers).splitlines()
    assert lines[0].startswith("| pair | concurrency | server | precision | output tok/s | × sightline HTTP |")
    table = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| pair")]
    assert table == [
        "| float32 | 1 | sightline HTTP (--dtype=float32) | float32 | 10.0 | 1.00× | 40 | 52.0 | 52.0 |",
        "| float32 | 1 | llama-server | GGUF F32 | 25.0 | 2.50× | 30 | 20.0 | 20.0 |",
        "| float32 | 16 | sightline HTTP (--dtype=float32) | float32 | 40.0 | 1.00× | 400 | 60.0 | 60.0 |",
        "| float32 | 16 | transformers serve | float32 | 20.0 | 0.50× | 300 | 80.0 | 80.0 |",
        "| float32 | 16 | llama-server | GGUF F32 | 80.0 | 2.00× | 200 | 40.0 | 40.0 |",
        "| float32 | pp 512 | sightline HTTP (--dtype=float32) | float32 | 512.0 | 1.00× | 1000 | – | – |",
        "| float32 | pp 512 | llama-server | GGUF F32 | 1024.0 | 2.00× | 500 | – | – |",
        "| GGUF Q8_0 | 16 | sightline HTTP (SmolLM2-135M-Instruct-Q8_0.gguf) | float32+gguf | 90.0 | 1.00× | 300 "
        "| 30.0 | 30.0 |",
        "| GGUF Q8_0 | 16 | llama-server | GGUF Q8_0 | 100.0 | 1.11× | 100 | 20.0 | 20.0 |",
        "| GGUF Q4_1 | 16 | sightline engine, in-process | gguf | 120.0 | 2.00× | – | – | – |",
        "| GGUF Q4_1 | 16 | sightline HTTP (SmolLM2-135M-Instruct.Q4_1.gguf) | float32+gguf | 60.0 | 1.00× | 200 "
        "| 25.0 | 25.0 |",
        "| GGUF Q4_1 | 16 | llama-server | GGUF Q4_1 (bundled) | 45.0 | 0.75× | 100 | 20.0 | 20.0 |",
        "| int8 | 16 | sightline engine, in-process | int8 | 99.0 | 1.98× | – | – | – |",
        "| int8 | 16 | sightline HTTP (--quantization=int8) | bfloat16+int8 | 50.0 | 1.00× | 300 | 30.0 | 30.0 |",
    ]
    notes = lines[len(table) + 2 :]
    assert "llama-server-Q4_K_M: skipped: its server exited with 1 on startup" in notes  # one line, with why
    assert "sightline HTTP (SmolLM2-135M-Instruct-Q8_0.gguf): pp skipped: no port" in notes
    assert "llama-server command: llama-server -m m-F32.gguf --host 127.0.0.1 -np 64" in notes


def test_the_table_works_with_files_missing():
    assert render(None, [], None).splitlines() == [
        *render(None, [], None).splitlines()[:2],
        "",
        "peers: no peers.json (run `python -m bench.peers`); no peer rows",
    ]
    skipped = {
        "prompt_len": 128,
        "gen_len": 64,
        "pp_len": 512,
        "sightline_pp": {},
        "peers": {name: {"label": name, "precision": "?", "skipped": "--skip-peers"} for name in PEER_NAMES},
    }
    lines = render(None, [], skipped).splitlines()
    assert len([ln for ln in lines if ln.startswith("|")]) == 2  # the head, no rows
    assert [ln for ln in lines if "skipped" in ln] == [f"{name}: skipped: --skip-peers" for name in PEER_NAMES]
    # a peer without our run of its precision still shows, with a line saying ours is missing
    only_peer = {
        **skipped,
        "peers": {
            "llama-server-Q8_0": {
                "label": "llama-server",
                "precision": "GGUF Q8_0",
                "levels": {"1": level([10.0], [5.0], 50.0)},
            }
        },
    }
    lines = render(None, [], only_peer).splitlines()
    assert "| GGUF Q8_0 | 1 | llama-server | GGUF Q8_0 | 50.0 | – | 10 | 5.0 | 5.0 |" in lines
    assert "GGUF Q8_0: no sightline HTTP run of this precision among the http*.json files" in lines


_CRASHY_SERVER = """
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)  # what llama-server's weight repacking does on some CPUs
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_peer_that_dies_of_a_signal_on_startup_is_started_again_with_its_retry_flags(tmp_path):
    import sys

    script = tmp_path / "server.py"
    script.write_text(_CRASHY_SERVER)
    peer = peers_mod.Peer(
        name="crashy",
        label="crashy",
        precision="x",
        pair="x",
        requirement="",
        prepare=lambda: (tmp_path, None),
        command=lambda _p, port, _s: [sys.executable, str(script), str(port)],
        ignore_eos=lambda n: {},
        health_path="/health",
        home=tmp_path,
        retry_args=("--no-repack",),
    )
    server = peers_mod.PeerServer(peer, tmp_path, 128, startup_s=30)
    try:
        assert server.argv[-1] == "--no-repack"  # what the result's `command` records
        assert peers_mod.httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    no_retry = peers_mod.Peer(**{**peer.__dict__, "retry_args": ()})
    with pytest.raises(peers_mod.Skip, match="exited with -11"):
        peers_mod.PeerServer(no_retry, tmp_path, 128, startup_s=30)
