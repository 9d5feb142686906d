"""Native CPU kernels: the C++ sources in kernels/, compiled once per machine into one library loaded with ctypes.

Every `kernels/*.cpp` goes into one shared library, so that all kernels share one thread team
(kernels/team.h: persistent workers that spin between the calls of a step, then sleep; the
caller never waits for a worker that has not woken).  Compiled with the system's g++ (`-O3
-march=native`) into `kernels/` under the server's cache directory (`--cache-dir`, else
$SIGHTLINE_KERNEL_CACHE, else the model cache's default), keyed by the sources, the flags, the
compiler and this CPU's feature flags, so a change to any of them (another CPU: an AVX-512
machine gets its own build) rebuilds and a warm start loads the cached library in milliseconds.
The team has as many threads as torch (`torch.set_num_threads`, read through the libgomp torch
loaded first) unless `start_team` says otherwise.

`march` (else $SIGHTLINE_KERNEL_MARCH, else `native`) builds for another instruction set than
this CPU's: the tests run the AVX2 code paths of an AVX-512 machine with `march="haswell"`.

No g++, or a failed build, is not an error: `load()` returns None with the reason, and
callers use their torch implementation.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch  # loaded first: its libgomp is the one the kernels link to

log = logging.getLogger(__name__)
KERNELS = Path(__file__).with_name("kernels")
FLAGS = ("-O3", "-fopenmp", "-pthread", "-shared", "-fPIC", "-std=c++17")
LIBRARY = "sightline-kernels"
CACHE_ENV = "SIGHTLINE_KERNEL_CACHE"
MARCH_ENV = "SIGHTLINE_KERNEL_MARCH"


def _cache_dir(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return cache_dir / "kernels"
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sightline" / "kernels"
    return Path(os.environ.get(CACHE_ENV, default))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


def _march(march: str | None) -> str:
    return march or os.environ.get(MARCH_ENV) or "native"


def build(cache_dir: Path | None = None, march: str | None = None, kernels: Path = KERNELS) -> Path:
    """Compile `kernels`/*.cpp (the engine's, unless a test names a small stub) into one library, unless
    cached, and return its path."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    sources = sorted(kernels.glob("*.cpp"))
    headers = sorted(kernels.glob("*.h"))
    flags = (*FLAGS, f"-march={_march(march)}")
    key = hashlib.sha256(
        b"\0".join(
            [
                *(p.name.encode() + p.read_bytes() for p in sources + headers),
                " ".join(flags).encode(),
                _compiler_version(cxx).encode(),
                _cpu_flags().encode(),
                torch.__version__.encode(),
            ]
        )
    ).hexdigest()[:16]
    out_dir = _cache_dir(cache_dir)
    lib = out_dir / f"{LIBRARY}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # same filesystem: the rename is atomic
        tmp_lib = Path(tmp) / lib.name
        proc = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(tmp_lib)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed on the kernels: {proc.stderr.strip()[-400:]}")
        os.replace(tmp_lib, lib)  # concurrent builders (several servers starting) all end with one file
    log.info("built the native kernels %s", lib)
    return lib


@cache
def load(cache_dir: Path | None = None, march: str | None = None) -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) when it cannot be built here."""
    try:
        return ctypes.CDLL(str(build(cache_dir, march)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native kernels unavailable, using the torch implementations: %s", exc)
        return None


def start_team(lib: ctypes.CDLL, threads: int, spin_us: int, worker_nice: int = 0) -> int:
    """Size the kernels' thread team, how long its idle workers spin before sleeping and their nice
    (the calling thread keeps its own); only the first call, before any kernel runs, has an effect.
    Returns the team's threads, caller included."""
    fn = lib.kernels_team_start
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int], ctypes.c_int
    return int(fn(threads, spin_us, worker_nice))
