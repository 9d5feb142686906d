"""Peer servers under the HTTP benchmarks' workload: `transformers serve` and llama-cpp-python's server.

    .venv/bin/python -m bench.peers [--concurrency 1,16,64] [--gen-len 64] [--json results/bench/peers.json]
    .venv/bin/python -m bench.peers --install-only      # set the virtualenvs up, run nothing

Each peer gets its own virtualenv, `results/bench/peers/<name>/venv`, reused while its stamp
matches.  It is made with our .venv's interpreter plus a `.pth` file that appends our .venv's
site-packages, so torch (the CPU wheel; download.pytorch.org may be out of reach), transformers
and numpy are shared, and pip installs only what the peer adds, into the peer's own
site-packages (first on its sys.path; our .venv is never written).  Logs sit beside the venv.

* `transformers`: `transformers serve --continuous-batching --dtype float32` (our pinned
  version, `[serving]` extra: FastAPI, uvicorn) on our fp32 safetensors of the bundled model.
* `llama-cpp`: `python -m llama_cpp.server` on the bundled Q4_1 GGUF, built from source by pip
  (scikit-build-core uses the system cmake, or pip's `cmake` if that is missing or too old;
  minutes on 2 cores), one thread per core, chat format from the GGUF, `interrupt_requests`
  off: it decodes one request at a time, so concurrent requests queue instead of cancelling.

Requests and measurement are bench.http's, from bench/common.py (`run_levels`): the same
prompts, sent as text that tokenizes back to bench.http's exact token ids, the same max
tokens, temperature 0, streaming; only the field that makes a server ignore EOS differs.  A
peer that cannot be installed or started is skipped with a one-line reason,
`{"skipped": reason}` in the JSON; the bench goes on.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from bench.common import TABLE_HEAD, level_prompts, run_levels, table_row, write_json
from serving.model_files import BUNDLED_MODEL, bundled_gguf_path, load_tokenizer, prepare_model_dir

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO / "results" / "bench" / "peers"
LLAMA_CPP_VERSION = "0.3.36"
PEER_NAMES = ("transformers", "llama-cpp")


class Skip(Exception):
    """A peer that cannot run here; the message is the one-line reason."""


@dataclass
class Peer:
    name: str
    label: str  # what the tables call the server
    precision: str
    requirement: str
    command: Callable[[Path, int], list[str]]  # (venv python, port) -> argv
    ignore_eos: Callable[[int], dict]  # gen_len -> the request fields that make this server ignore EOS
    health_path: str
    build_env: dict[str, str] = field(default_factory=dict)
    check_import: str = ""


def transformers_model_dir() -> Path:
    """Our prepared fp32 safetensors directory of the bundled model, as `transformers serve`
    loads it: linked file by file beside the peer's venv, with `architectures` added to the
    config (our GGUF conversion leaves it unset; transformers serve picks the class from it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src, out = prepare_model_dir(BUNDLED_MODEL)[0], PEERS_DIR / "transformers" / "model"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config.setdefault("architectures", None)
    config["architectures"] = config["architectures"] or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def make_peers() -> list[Peer]:
    """Both serve the bundled SmolLM2-135M-Instruct: transformers our fp32 safetensors
    directory of it, llama.cpp its GGUF file itself."""
    tf_version = importlib.metadata.version("transformers")
    return [
        Peer(
            name="transformers",
            label=f"transformers {tf_version} serve --continuous-batching",
            precision="float32",
            requirement=f"transformers[serving]=={tf_version}",
            command=lambda py, port: [
                str(py), "-m", "transformers.cli.transformers", "serve", str(transformers_model_dir()),
                "--continuous-batching", "--dtype", "float32", "--device", "cpu",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            # A request's `generation_config` replaces the model's, whose eos_token_id it leaves out.
            ignore_eos=lambda n: {"generation_config": json.dumps({"max_new_tokens": n, "do_sample": False})},
            health_path="/health",
            check_import="fastapi, uvicorn, transformers.cli.serving.server",
        ),
        Peer(
            name="llama-cpp",
            label=f"llama-cpp-python {LLAMA_CPP_VERSION} server",
            precision="GGUF Q4_1",
            requirement=f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}",
            command=lambda py, port: [
                str(py), "-m", "llama_cpp.server", "--model", str(bundled_gguf_path()), "--host", "127.0.0.1",
                "--port", str(port), "--n_threads", str(os.cpu_count()), "--n_threads_batch", str(os.cpu_count()),
                "--n_ctx", "2048", "--interrupt_requests", "False", "--verbose", "False"],
            # min_tokens masks EOS until max_tokens; its sampler default repeat_penalty 1.1 would not be greedy.
            ignore_eos=lambda n: {"min_tokens": n, "repeat_penalty": 1.0},
            health_path="/v1/models",
            build_env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count()), "CMAKE_ARGS": "-DLLAVA_BUILD=OFF"},
            check_import="llama_cpp.server.app",
        ),
    ]


def ensure_venv(peer: Peer) -> tuple[Path, float | None]:
    """(the venv's python, install seconds or None when reused): made and installed once, the
    stamp holding what was installed; a failed step raises Skip quoting the install log."""
    home = PEERS_DIR / peer.name
    venv, log = home / "venv", home / "install.log"
    py, stamp = venv / "bin" / "python", venv / ".bench-installed"
    if py.exists() and stamp.exists() and stamp.read_text() == peer.requirement:
        return py, None
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        def step(argv: list[str], what: str, env: dict | None = None) -> None:
            fh.write(f"$ {' '.join(argv)}\n")
            fh.flush()
            if subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode:
                raise Skip(f"{what} failed (log: {_rel(log)}): {_last_line(log)}")

        if not py.exists():
            step([sys.executable, "-m", "venv", str(venv)], "creating the virtualenv")
        # The same interpreter, so the same layout: our purelib with the venv's prefix.
        ours = Path(sysconfig.get_paths()["purelib"])
        (venv / ours.relative_to(sys.prefix) / "sightline-shared.pth").write_text(f"{ours}\n")
        print(f"{peer.name}: installing {peer.requirement} into {_rel(venv)} "
              f"(log: {_rel(log)}) ...", flush=True)
        step([str(py), "-m", "pip", "install", "--disable-pip-version-check", peer.requirement],
             f"pip install {peer.requirement}", env={**os.environ, **peer.build_env})
        if peer.check_import:
            step([str(py), "-c", f"import {peer.check_import}"], "importing the installed server")
    stamp.write_text(peer.requirement)
    seconds = round(time.monotonic() - t0, 1)
    print(f"{peer.name}: installed in {seconds:.0f} s", flush=True)
    return py, seconds


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return ((errors or lines or ["(empty log)"])[-1])[:200]


class PeerServer:
    """The peer's server on a free loopback port, healthy on return; its log beside the venv."""

    def __init__(self, peer: Peer, py: Path, startup_s: float = 600.0) -> None:
        from loadtest.server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = PEERS_DIR / peer.name / "server.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        self.proc = subprocess.Popen(peer.command(py, self.port), cwd=PEERS_DIR / peer.name, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise Skip(f"its server exited with {self.proc.returncode} on startup "
                           f"(log: {_rel(self.log_path)}): {_last_line(self.log_path)}")
            try:
                if httpx.get(self.url + peer.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise Skip(f"its server was not healthy within {startup_s:g} s "
                           f"(log: {_rel(self.log_path)})")
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def peer_prompts(levels: list[int], prompt_len: int) -> dict[int, list[str]]:
    """bench.http's prompts, as text: each tokenizes back to exactly bench.http's token ids."""
    tok, _ = load_tokenizer(BUNDLED_MODEL)
    ids = level_prompts(types.SimpleNamespace(tokenizer=tok), levels, prompt_len)
    text = {n: [tok.decode(x) for x in ids[n]] for n in levels}
    if any(tok(t)["input_ids"] != x for n in levels for t, x in zip(text[n], ids[n])):
        raise SystemExit("bench.peers: a prompt does not tokenize back to bench.http's ids; no fair comparison")
    return text


def run_peer(peer: Peer, prompts: dict[int, list[str]], gen_len: int) -> dict:
    """The peer's rows ({concurrency: bench.http result}), or {"skipped": reason}."""
    record: dict = {"label": peer.label, "precision": peer.precision, "requirement": peer.requirement}
    server = None
    try:
        py, record["install_s"] = ensure_venv(peer)
        t0 = time.monotonic()
        server = PeerServer(peer, py)
        record["startup_s"] = round(time.monotonic() - t0, 1)
        record["command"] = " ".join(peer.command(py, server.port))
        record["levels"] = run_levels(server.url, prompts, gen_len, extra=peer.ignore_eos(gen_len))
        for n, r in record["levels"].items():
            if r["tokens"] != n * gen_len:  # its way of ignoring EOS did not hold: say so beside the numbers
                record.setdefault("notes", []).append(f"c={n}: {r['tokens']} output tokens, not {n * gen_len}")
                print(f"{peer.name}: WARNING: {record['notes'][-1]}", flush=True)
    except Exception as exc:  # noqa: BLE001 - one peer's failure never ends the bench
        reason = (str(exc).splitlines() or [""])[0] or type(exc).__name__
        if server is not None and not isinstance(exc, Skip):
            reason = f"failed while measuring: {reason} (log: {_rel(server.log_path)})"
        print(f"{peer.name}: skipped: {reason}", flush=True)
        return {**record, "skipped": reason}
    finally:
        if server is not None:
            server.stop()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--peers", default=",".join(PEER_NAMES), help=f"comma-separated, of {', '.join(PEER_NAMES)}")
    ap.add_argument("--install-only", action="store_true", help="set the virtualenvs up and stop")
    ap.add_argument("--skip-peers", action="store_true", help="run nothing; record every peer as skipped")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    a.levels = [int(x) for x in a.concurrency.split(",")]
    a.peer_names = [x for x in a.peers.split(",") if x]
    if unknown := set(a.peer_names) - set(PEER_NAMES):
        ap.error(f"unknown peer(s): {', '.join(sorted(unknown))}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    peers = [p for p in make_peers() if p.name in a.peer_names]
    results: dict[str, dict] = {}
    if a.skip_peers:
        for p in peers:
            print(f"{p.name}: skipped: --skip-peers")
            results[p.name] = {"label": p.label, "precision": p.precision, "skipped": "--skip-peers"}
    elif a.install_only:
        for p in peers:
            try:
                ensure_venv(p)
            except Skip as exc:
                print(f"{p.name}: skipped: {exc}")
        return
    else:
        prompts = peer_prompts(a.levels, a.prompt_len)
        for p in peers:
            results[p.name] = run_peer(p, prompts, a.gen_len)
    if a.json:
        write_json(a.json, {"model": BUNDLED_MODEL, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                            "cpus": os.cpu_count(), "peers": results})
    measured = {name: r for name, r in results.items() if "levels" in r and "skipped" not in r}
    if not measured:
        return
    print(f"\npeers: model {BUNDLED_MODEL}, prompt {a.prompt_len} tokens, {a.gen_len} new tokens per request, "
          f"{os.cpu_count()} CPUs\n")
    print(TABLE_HEAD.replace("| path |", "| server |"))
    for name, r in measured.items():
        for n, level in r["levels"].items():
            print(table_row(n, f"{r['label']}, {r['precision']}", level))


if __name__ == "__main__":
    main()
