"""Peer servers under the HTTP benchmarks' workload: `transformers serve` and llama.cpp's `llama-server`.

    .venv/bin/python -m bench.peers [--concurrency 1,16,64] [--gen-len 64] [--json results/bench/peers.json]
    .venv/bin/python -m bench.peers --install-only      # build / install the peers and their GGUF files, run nothing
    .venv/bin/python -m bench.peers --peers llama-server-Q8_0,transformers   # a subset

* `transformers`: `transformers serve --continuous-batching --dtype float32` (our pinned
  version, `[serving]` extra: FastAPI, uvicorn) on our fp32 safetensors of the bundled model,
  in its own virtualenv `results/bench/peers/transformers/venv`, made with our .venv's
  interpreter plus a `.pth` file that appends our .venv's site-packages (torch, transformers,
  numpy are shared; pip installs only what the peer adds, into the peer's own site-packages;
  our .venv is never written).
* `llama-server-F32`, `-Q8_0`, `-Q4_K_M`, `-Q4_1` (`--peers llama-server` means all four):
  llama.cpp's own server, continuous batching over 64 slots
  (`-np 64 --cont-batching -t <cores>`, bound to 127.0.0.1 only), one GGUF file each.  llama.cpp
  comes from the llama-cpp-python sdist on PyPI (`pip download`; it vendors the whole
  llama.cpp tree), built once with cmake under `results/bench/peers/llama-server/build`
  (`-march=native`; about a quarter of an hour on 2 cores), rebuilt when the version, the
  cmake options or the CPU's flags change (the stamp `build/.bench-built` holds all three).
  The F32 file is llama.cpp's `convert_hf_to_gguf.py` on the same fp32 safetensors directory
  the transformers peer serves (which is the bundled Q4_1 GGUF dequantized: every file holds
  the same weights, rounded differently; a copy stores the tied embedding as
  `embed_tokens`, which the converter needs); Q8_0 and Q4_K_M are `llama-quantize` of it; Q4_1 is
  the bundled file itself.  The converter runs in a small venv beside the build (our
  packages plus `sentencepiece`, which it imports unconditionally).  Nothing of llama.cpp
  leaves `results/` (git-ignored).

Requests and measurement are bench.http's, from bench/common.py (`run_levels`): the same
prompts, sent as text that tokenizes back to bench.http's exact token ids, the same max
tokens, temperature 0, streaming; only the field that makes a server ignore EOS differs.
Prompt processing (`pp`, as llama-bench calls it) is measured for every server, ours too
(started as bench.http starts it, once float32 and once `--quantization int8`): one
`--pp-len`-token prompt at a time, `max_tokens` 1, prompt tokens ÷ TTFT, the median of
`PP_REPEATS` prompts nobody has seen before.  A peer that cannot be installed or started is
skipped with a one-line reason, `{"skipped": reason}` in the JSON; the bench goes on.
`python -m bench.table` puts each peer beside our run of the same precision.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from bench.common import http_run, level_prompts, make_prompts, run_levels, start_server, write_json
from serving.model_files import BUNDLED_MODEL, bundled_gguf_path, load_tokenizer, prepare_model_dir

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO / "results" / "bench" / "peers"
LLAMA_DIR = PEERS_DIR / "llama-server"
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
GGUF_TYPES = ("F32", "Q8_0", "Q4_K_M", "Q4_1")
PEER_NAMES = ("transformers", *(f"llama-server-{t}" for t in GGUF_TYPES))
SLOTS = 64  # llama-server's parallel sequences: the largest concurrency `make bench` sends
PP_REPEATS = 3
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",  # LLAMA_CURL is gone in this llama.cpp (deprecated, no download support left)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI, and no download of one at build time
)
LLAMA_TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
CONVERT_REQUIREMENT = "sentencepiece==0.2.3"  # convert_hf_to_gguf.py imports it even for BPE vocabularies


class Skip(Exception):
    """A peer that cannot run here; the message is the one-line reason."""


@dataclass
class Peer:
    name: str
    label: str  # what the tables call the server
    precision: str
    pair: str  # which of our runs it sits beside in bench.table: "float32" or "int8"
    requirement: str  # what is installed or built for it
    prepare: Callable[[], tuple[Path, float | None]]  # -> (what `command` runs, setup seconds or None when cached)
    command: Callable[[Path, int, int], list[str]]  # (prepared path, port, tokens per sequence) -> argv
    ignore_eos: Callable[[int], dict]  # gen_len -> the request fields that make this server ignore EOS
    health_path: str
    home: Path = PEERS_DIR  # its logs and working directory
    log_name: str = "server.log"
    # flags for a second start when the first dies of a signal on startup (llama-server's weight
    # repacking segfaults at load on a 2-core Sapphire Rapids VM: it retries with --no-repack)
    retry_args: tuple[str, ...] = ()


# ---------------------------------------------------------------- virtualenvs (transformers, the GGUF converter)


def ensure_venv(
    home: Path, requirement: str, check_import: str = "", build_env: dict | None = None, what: str = ""
) -> tuple[Path, float | None]:
    """(`home`/venv's python, install seconds or None when reused): made and installed once, the
    stamp holding what was installed; a failed step raises Skip quoting the install log."""
    what = what or home.name
    venv, log = home / "venv", home / "install.log"
    py, stamp = venv / "bin" / "python", venv / ".bench-installed"
    if py.exists() and stamp.exists() and stamp.read_text() == requirement:
        return py, None
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:

        def step(argv: list[str], doing: str, env: dict | None = None) -> None:
            fh.write(f"$ {' '.join(argv)}\n")
            fh.flush()
            if subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode:
                raise Skip(f"{doing} failed (log: {_rel(log)}): {_last_line(log)}")

        if not py.exists():
            step([sys.executable, "-m", "venv", str(venv)], "creating the virtualenv")
        # The same interpreter, so the same layout: our purelib with the venv's prefix.
        ours = Path(sysconfig.get_paths()["purelib"])
        (venv / ours.relative_to(sys.prefix) / "sightline-shared.pth").write_text(f"{ours}\n")
        print(f"{what}: installing {requirement} into {_rel(venv)} (log: {_rel(log)}) ...", flush=True)
        step(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", requirement],
            f"pip install {requirement}",
            env={**os.environ, **(build_env or {})},
        )
        if check_import:
            step([str(py), "-c", f"import {check_import}"], "importing the installed packages")
    stamp.write_text(requirement)
    seconds = round(time.monotonic() - t0, 1)
    print(f"{what}: installed in {seconds:.0f} s", flush=True)
    return py, seconds


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return ((errors or lines or ["(empty log)"])[-1])[:200]


def _run_logged(argv: list[str], log: Path, doing: str, cwd: Path | None = None) -> None:
    """`argv` with its output appended to `log`; Skip quoting the log when it fails."""
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(argv)}\n")
        fh.flush()
        if subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd).returncode:
            raise Skip(f"{doing} failed (log: {_rel(log)}): {_last_line(log)}")


# ---------------------------------------------------------------- transformers serve


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


# ---------------------------------------------------------------- llama.cpp: source, build, GGUF files


def llama_tree() -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist, unpacked under results/."""
    return LLAMA_DIR / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"


def cpu_flags() -> str:
    """What `-march=native` compiles for: the CPU's model name and a hash of its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"
    first = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = " ".join(sorted(first.get("flags", first.get("Features", "")).split()))
    return f"{first.get('model name', '?')}; flags sha256 {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def build_stamp() -> str:
    """What a build depends on; a build whose stamp differs is redone from scratch."""
    return (
        f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_VERSION}\ncmake {' '.join(CMAKE_OPTIONS)}\n"
        f"targets {' '.join(LLAMA_TARGETS)}\ncpu {cpu_flags()}\n"
    )


def fetch_llama_source(log: Path) -> Path:
    """The sdist, fetched with pip and unpacked once; Skip when it has no vendored llama.cpp."""
    tree = llama_tree()
    if (tree / "CMakeLists.txt").is_file():
        return tree
    src = LLAMA_DIR / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not sdist.is_file():
        print(
            f"llama-server: fetching the llama-cpp-python {LLAMA_CPP_VERSION} sdist (log: {_rel(log)}) ...", flush=True
        )
        _run_logged(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--disable-pip-version-check",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
                "-d",
                str(src),
            ],
            log,
            "pip download",
        )
    with tarfile.open(sdist) as tar:
        tar.extractall(src, filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise Skip(f"the llama-cpp-python {LLAMA_CPP_VERSION} sdist has no vendor/llama.cpp")
    return tree


def ensure_llama_server() -> tuple[Path, float | None]:
    """(the folder holding llama-server and llama-quantize, build seconds or None when cached)."""
    build, log = LLAMA_DIR / "build", LLAMA_DIR / "build.log"
    bindir, stamp, want = build / "bin", build / ".bench-built", build_stamp()
    if stamp.is_file() and stamp.read_text() == want and all((bindir / t).is_file() for t in LLAMA_TARGETS):
        return bindir, None
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise Skip("building llama.cpp needs cmake and a C++ compiler (apt-get install cmake g++)")
    LLAMA_DIR.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    t0 = time.monotonic()
    tree = fetch_llama_source(log)
    if stamp.is_file():  # another version, other options or another CPU: nothing of the old build is kept
        print("llama-server: the build's stamp changed (version, options or CPU); rebuilding from scratch", flush=True)
        shutil.rmtree(build)
    print(
        f"llama-server: building llama.cpp ({', '.join(LLAMA_TARGETS)}) with {os.cpu_count()} jobs "
        f"(log: {_rel(log)}; about a quarter of an hour on 2 cores) ...",
        flush=True,
    )
    _run_logged(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_OPTIONS], log, "cmake configure")
    _run_logged(
        ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *LLAMA_TARGETS],
        log,
        "cmake --build",
    )
    stamp.write_text(want)
    seconds = round(time.monotonic() - t0, 1)
    print(f"llama-server: built in {seconds:.0f} s", flush=True)
    return bindir, seconds


def gguf_path(gguf_type: str) -> Path:
    """Where each peer's GGUF file is: the bundled file for Q4_1, the rest made by `ensure_gguf`."""
    if gguf_type == "Q4_1":
        return bundled_gguf_path()
    return LLAMA_DIR / f"gguf-{LLAMA_CPP_VERSION}" / f"{BUNDLED_MODEL}-{gguf_type}.gguf"


def converter_model_dir() -> Path:
    """transformers_model_dir() as llama.cpp's converter wants it: our safetensors store the tied
    embedding once, as `lm_head.weight`, which the converter would write as `output.weight`
    with no `token_embd.weight` (llama.cpp then refuses the file); here it is stored as
    `model.embed_tokens.weight` instead (the same tensor; the config says the two are tied)."""
    from safetensors.numpy import load_file, save_file

    src, out = transformers_model_dir(), LLAMA_DIR / "hf-model"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    weights = out / "model.safetensors"
    if not weights.is_file():
        tensors = load_file(src / "model.safetensors")
        tied = json.loads((src / "config.json").read_text()).get("tie_word_embeddings")
        if tied and "model.embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
            tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
        save_file(tensors, weights.with_suffix(".partial"), metadata={"format": "pt"})
        weights.with_suffix(".partial").rename(weights)
    return out


def ensure_gguf(gguf_type: str, bindir: Path) -> tuple[Path, float | None]:
    """(the GGUF file, seconds spent making it or None when cached): F32 from llama.cpp's own
    converter on our fp32 safetensors, the others `llama-quantize`d from F32."""
    out = gguf_path(gguf_type)
    if out.is_file():
        return out, None
    if gguf_type == "Q4_1":
        raise Skip(f"the bundled GGUF is missing: {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    log, t0 = LLAMA_DIR / "gguf.log", time.monotonic()
    tmp = out.with_suffix(".partial")
    if gguf_type == "F32":
        py, _ = ensure_venv(
            LLAMA_DIR / "convert",
            CONVERT_REQUIREMENT,
            "sentencepiece, gguf, torch",
            what="llama-server (GGUF converter)",
        )
        print(f"llama-server: converting {BUNDLED_MODEL} to GGUF F32 (log: {_rel(log)}) ...", flush=True)
        _run_logged(
            [
                str(py),
                str(llama_tree() / "convert_hf_to_gguf.py"),
                str(converter_model_dir()),
                "--outfile",
                str(tmp),
                "--outtype",
                "f32",
            ],
            log,
            "convert_hf_to_gguf.py",
        )
    else:
        f32, _ = ensure_gguf("F32", bindir)
        print(f"llama-server: quantizing to {gguf_type} (log: {_rel(log)}) ...", flush=True)
        _run_logged(
            [str(bindir / "llama-quantize"), str(f32), str(tmp), gguf_type, str(os.cpu_count() or 1)],
            log,
            f"llama-quantize {gguf_type}",
        )
    tmp.rename(out)
    return out, round(time.monotonic() - t0, 1)


def prepare_llama_server(gguf_type: str) -> tuple[Path, float | None]:
    """The built binaries' folder, with the peer's GGUF file made; seconds when anything was done."""
    bindir, built = ensure_llama_server()
    _, made = ensure_gguf(gguf_type, bindir)
    return bindir, None if built is None and made is None else round((built or 0) + (made or 0), 1)


def llama_server_command(
    bindir: Path, port: int, seq_tokens: int, gguf_type: str, threads: int | None = None, slots: int = SLOTS
) -> list[str]:
    """llama-server on 127.0.0.1 only (its default host too; an explicit flag so nothing can
    change that), `slots` sequences continuously batched, `threads` (default: one per core) for
    decode and prompt batches, a context of `slots` × `seq_tokens` (every slot fits a whole
    request), no web UI."""
    cores = str(threads or os.cpu_count() or 1)
    return [
        str(bindir / "llama-server"),
        "-m",
        str(gguf_path(gguf_type)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "--cont-batching",
        "-t",
        cores,
        "-tb",
        cores,
        "-c",
        str(slots * seq_tokens),
        "--no-webui",
        "--alias",
        f"{BUNDLED_MODEL}-{gguf_type}",
    ]


def make_peers() -> list[Peer]:
    """All serve the bundled SmolLM2-135M-Instruct: transformers our fp32 safetensors directory
    of it, llama-server a GGUF file of it in each type."""
    tf_version = importlib.metadata.version("transformers")
    tf_home = PEERS_DIR / "transformers"
    tf_req = f"transformers[serving]=={tf_version}"
    peers = [
        Peer(
            name="transformers",
            label=f"transformers {tf_version} serve --continuous-batching",
            precision="float32",
            pair="float32",
            requirement=tf_req,
            prepare=lambda: ensure_venv(
                tf_home, tf_req, "fastapi, uvicorn, transformers.cli.serving.server", what="transformers"
            ),
            command=lambda py, port, _seq: [
                str(py),
                "-m",
                "transformers.cli.transformers",
                "serve",
                str(transformers_model_dir()),
                "--continuous-batching",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            # A request's `generation_config` replaces the model's, whose eos_token_id it leaves out.
            ignore_eos=lambda n: {"generation_config": json.dumps({"max_new_tokens": n, "do_sample": False})},
            health_path="/health",
            home=tf_home,
        ),
    ]
    for t in GGUF_TYPES:
        peers.append(
            Peer(
                name=f"llama-server-{t}",
                label="llama-server",
                precision=f"GGUF {t}" + (" (bundled)" if t == "Q4_1" else ""),
                pair="float32" if t == "F32" else f"GGUF {t}",  # ours on the same file beside it
                requirement=f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_VERSION}",
                prepare=lambda t=t: prepare_llama_server(t),
                command=lambda bindir, port, seq, t=t: llama_server_command(bindir, port, seq, t),
                # Its sampler's penalties are off by default (repeat_penalty 1.0): temperature 0 is greedy.
                ignore_eos=lambda n: {"ignore_eos": True},
                health_path="/health",  # 503 while the model loads, 200 once it serves
                home=LLAMA_DIR,
                log_name=f"server-{t}.log",
                retry_args=("--no-repack",),
            )
        )
    return peers


# ---------------------------------------------------------------- running a server


class PeerServer:
    """The peer's server on a free loopback port, healthy on return; its log in the peer's home."""

    def __init__(self, peer: Peer, prepared: Path, seq_tokens: int, startup_s: float = 600.0) -> None:
        from loadtest.server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = peer.home / peer.log_name
        peer.home.mkdir(parents=True, exist_ok=True)
        argv = peer.command(prepared, self.port, seq_tokens)
        try:
            self._start(peer, argv, startup_s)
        except Skip:
            if not peer.retry_args or self.died_of is None or self.died_of >= 0:
                raise
            print(
                f"{peer.name}: its server died of signal {-self.died_of} on startup; "
                f"starting it again with {' '.join(peer.retry_args)}",
                flush=True,
            )
            self._start(peer, argv + list(peer.retry_args), startup_s)

    def _start(self, peer: Peer, argv: list[str], startup_s: float) -> None:
        self.argv, self.died_of = argv, None  # died_of: its exit status, when it ended on its own
        self._log = open(self.log_path, "wb")
        # No LLAMA_ARG_* from our environment: llama-server reads its flags from them too (--host among them).
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
        self.proc = subprocess.Popen(
            self.argv, cwd=peer.home, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                self.died_of = self.proc.returncode
                self.stop()
                raise Skip(
                    f"its server exited with {self.proc.returncode} on startup "
                    f"(log: {_rel(self.log_path)}): {_last_line(self.log_path)}"
                )
            try:
                if httpx.get(self.url + peer.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise Skip(f"its server was not healthy within {startup_s:g} s (log: {_rel(self.log_path)})")
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


# ---------------------------------------------------------------- the workload


def _tokenizer_ns():
    tok, _ = load_tokenizer(BUNDLED_MODEL)
    return tok, types.SimpleNamespace(tokenizer=tok)


def _as_text(tok, ids: list[list[int]]) -> list[str]:
    text = [tok.decode(x) for x in ids]
    if any(tok(t)["input_ids"] != x for t, x in zip(text, ids)):
        raise SystemExit("bench.peers: a prompt does not tokenize back to bench.http's ids; no fair comparison")
    return text


def peer_prompts(levels: list[int], prompt_len: int) -> dict[int, list[str]]:
    """bench.http's prompts, as text: each tokenizes back to exactly bench.http's token ids."""
    tok, ns = _tokenizer_ns()
    ids = level_prompts(ns, levels, prompt_len)
    return {n: _as_text(tok, ids[n]) for n in levels}


def pp_prompts(levels: list[int], pp_len: int) -> tuple[list[list[int]], list[str]]:
    """PP_REPEATS `pp_len`-token prompts after every level's (so new to a server that ran the
    levels), as token ids (ours) and as text that tokenizes back to them (the peers)."""
    tok, ns = _tokenizer_ns()
    ids = make_prompts(ns, PP_REPEATS, pp_len, start=sum(levels))
    return ids, _as_text(tok, ids)


def one_request(url: str, prompt, gen_len: int, extra: dict | None = None) -> dict:
    """One streamed request on its own (bench.common's client): its http_run result."""
    return asyncio.run(http_run(url, [prompt], gen_len, extra=extra))


def measure_pp(url: str, prompts: list, extra: dict | None = None) -> list[float]:
    """Prompt processing: each prompt alone, max_tokens 1, one after another; their TTFTs in ms."""
    return [one_request(url, p, 1, extra)["ttft"][0] for p in prompts]


def pp_summary(ttft: list[float], pp_len: int) -> dict:
    """What the JSON keeps of a pp run: prompt tokens, the TTFTs, their median, tokens/s from it."""
    p50 = statistics.median(ttft)
    return {"prompt_tokens": pp_len, "ttft": ttft, "ttft_p50_ms": p50, "tok_s": 1000 * pp_len / p50}


def run_peer(
    peer: Peer, prompts: dict[int, list[str]], gen_len: int, pp_text: list[str], pp_len: int, seq_tokens: int
) -> dict:
    """The peer's rows ({concurrency: bench.http result}) and its pp, or {"skipped": reason}."""
    record: dict = {
        "label": peer.label,
        "precision": peer.precision,
        "pair": peer.pair,
        "requirement": peer.requirement,
    }
    server = None
    try:
        prepared, record["install_s"] = peer.prepare()
        t0 = time.monotonic()
        server = PeerServer(peer, prepared, seq_tokens)
        record["startup_s"] = round(time.monotonic() - t0, 1)
        record["command"] = " ".join(server.argv)
        record["levels"] = run_levels(server.url, prompts, gen_len, extra=peer.ignore_eos(gen_len))
        for n, r in record["levels"].items():
            if r["tokens"] != n * gen_len:  # its way of ignoring EOS did not hold: say so beside the numbers
                record.setdefault("notes", []).append(f"c={n}: {r['tokens']} output tokens, not {n * gen_len}")
                print(f"{peer.name}: WARNING: {record['notes'][-1]}", flush=True)
        if pp_text:
            record["pp"] = pp_summary(measure_pp(server.url, pp_text, peer.ignore_eos(1)), pp_len)
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


def our_run(pair: str) -> tuple[str, list[str]]:
    """(model, flags) of our server in a pair, as make bench's http*.json start it: float32 on the bundled
    model (its weights expanded: the default would serve the file's own Q4_1), a GGUF pair on the very file
    its llama-server peer serves, in its own types (the default)."""
    if pair == "float32":
        return BUNDLED_MODEL, ["--dtype=float32", "--quantization=none"]
    return str(gguf_path(pair.split()[1])), []


def run_our_pp(pair: str, pp_ids: list[list[int]], pp_len: int) -> dict:
    """Our server's pp, started as bench.http starts it (bench.common.start_server)."""
    from loadtest.server import free_port

    model, flags = our_run(pair)
    record: dict = {"server_args": flags, "model": model}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            server = start_server(model, free_port(), Path(tmp) / "server.log", flags)
            try:
                one_request(server.url, pp_ids[0][::-1], 1)  # warm-up, a prompt nobody else sends
                record.update(pp_summary(measure_pp(server.url, pp_ids), pp_len))
            finally:
                server.stop()
    except Exception as exc:  # noqa: BLE001
        reason = (str(exc).splitlines() or [""])[0] or type(exc).__name__
        print(f"sightline {pair}: pp skipped: {reason}", flush=True)
        record["skipped"] = reason
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--pp-len", type=int, default=512, help="prompt tokens of the pp measurement (0: none)")
    ap.add_argument(
        "--peers",
        default=",".join(PEER_NAMES),
        help=f"comma-separated, of {', '.join(PEER_NAMES)}; `llama-server` means all four of it",
    )
    ap.add_argument("--install-only", action="store_true", help="build / install the peers and stop")
    ap.add_argument(
        "--gguf-path",
        metavar="TYPE",
        choices=GGUF_TYPES,
        help="make llama-server's GGUF file of TYPE if missing, print its path and stop",
    )
    ap.add_argument("--skip-peers", action="store_true", help="run nothing; record every peer as skipped")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    a.levels = [int(x) for x in a.concurrency.split(",")]
    names = []
    for x in filter(None, a.peers.split(",")):
        names += [n for n in PEER_NAMES if n.startswith("llama-server-")] if x == "llama-server" else [x]
    a.peer_names = list(dict.fromkeys(names))
    if unknown := set(a.peer_names) - set(PEER_NAMES):
        ap.error(f"unknown peer(s): {', '.join(sorted(unknown))}")
    if max(a.levels) > SLOTS:
        ap.error(f"llama-server runs {SLOTS} slots: concurrency at most {SLOTS}")
    return a


def main(argv: list[str] | None = None) -> None:
    from bench.table import render

    a = parse_args(argv)
    if a.gguf_path:  # the last line printed is the path (or nothing, when it cannot be made here)
        try:
            if a.gguf_path != "Q4_1":  # the bundled file needs no build
                prepare_llama_server(a.gguf_path)
            print(gguf_path(a.gguf_path))
        except Skip as exc:
            print(f"llama-server-{a.gguf_path}: skipped: {exc}", file=sys.stderr)
            print()
        return
    peers = [p for p in make_peers() if p.name in a.peer_names]
    results: dict[str, dict] = {}
    ours: dict[str, dict] = {}
    if a.skip_peers:
        for p in peers:
            print(f"{p.name}: skipped: --skip-peers")
            results[p.name] = {"label": p.label, "precision": p.precision, "pair": p.pair, "skipped": "--skip-peers"}
    elif a.install_only:
        for p in peers:
            try:
                p.prepare()
            except Skip as exc:
                print(f"{p.name}: skipped: {exc}")
        return
    else:
        prompts = peer_prompts(a.levels, a.prompt_len)
        pp_ids, pp_text = pp_prompts(a.levels, a.pp_len) if a.pp_len else ([], [])
        # Each slot holds a whole request: the levels' and the pp prompt's, rounded up to 256.
        seq_tokens = -(-max(a.prompt_len + a.gen_len, a.pp_len + 1) // 256) * 256
        for p in peers:
            results[p.name] = run_peer(p, prompts, a.gen_len, pp_text, a.pp_len, seq_tokens)
        if pp_ids:
            for pair in sorted({p.pair for p in peers}):
                ours[pair] = run_our_pp(pair, pp_ids, a.pp_len)
    doc = {
        "model": BUNDLED_MODEL,
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "pp_len": a.pp_len,
        "cpus": os.cpu_count(),
        "peers": results,
        "sightline_pp": ours,
    }
    if a.json:
        write_json(a.json, doc)
    print()
    print(render(None, [], doc))


if __name__ == "__main__":
    main()
