"""The native kernels' thread team (kernels/team.cpp): every chunk of every job runs exactly once,
whatever the job's size (beyond the 16-bit count one job word holds), however many jobs follow each
other, and with several Python threads calling kernels at once (ctypes drops the GIL)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from serving.models.layers import native, native_linear
from tests.helpers import REPO


@pytest.fixture(scope="module")
def check():
    lib = native.load()
    if lib is None:
        pytest.fail("the native kernels did not build here (is g++ installed?)")
    fn = lib.kernels_team_check
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None

    def run(chunks: int, spin_ns: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.zeros(chunks, dtype=torch.int32)
        threads = torch.zeros(chunks, dtype=torch.int32)
        fn(chunks, counts.data_ptr(), threads.data_ptr(), spin_ns)
        return counts, threads

    return run


@pytest.mark.parametrize("chunks", [1, 2, 3, 64, 1000, 65535, 65536, 200_001])
def test_every_chunk_runs_once(check, chunks):
    counts, _ = check(chunks)
    assert bool((counts == 1).all())


def test_back_to_back_jobs_never_mix(check):
    """A worker still finishing one job while the caller starts the next must not run the new one's
    chunks with the old one's function: 5000 jobs of varying size, each checked."""
    for i in range(5000):
        counts, _ = check(1 + i % 37)
        assert bool((counts == 1).all()), i


def test_concurrent_callers_each_get_correct_results():
    kernel = native_linear.select("native", "float32", "none")[0]
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3000, 576, generator=gen) / 24
    packed = kernel.pack(w)
    errors: list[str] = []

    def call(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(40):
            x = torch.randn(1 + seed % 9, 576, generator=g)
            if not torch.allclose(kernel(x, packed, None, 3000), F.linear(x, w), atol=2e-5, rtol=2e-5):
                errors.append(f"thread {seed}")

    threads = [threading.Thread(target=call, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("spin_us", [0, 1000])
def test_the_workers_take_part_and_the_spin_is_set(spin_us):
    """In a fresh process (the team starts once per process): a team of 2 with the given spin runs
    a 100 ms job on both threads — with spin 0 the worker sleeps between jobs and is woken."""
    code = f"""
import ctypes, time, torch
from serving.models.layers import native
lib = native.load()
assert native.start_team(lib, 2, {spin_us}) == 2
fn = lib.kernels_team_check
fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
for _ in range(3):
    time.sleep(0.01)  # long enough for a spin-0 worker to be asleep
    counts = torch.zeros(200, dtype=torch.int32)
    threads = torch.zeros(200, dtype=torch.int32)
    fn(200, counts.data_ptr(), threads.data_ptr(), 500_000)
    assert bool((counts == 1).all())
    print(len(set(threads.tolist())))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(int(n) == 2 for n in out.stdout.split()), out.stdout


def test_the_workers_run_at_their_nice_and_the_caller_keeps_its_own():
    """`--kernel-worker-nice`: in a fresh process, the team's worker threads run at the nice given,
    the calling thread (the Scheduler's) at the process's."""
    code = """
import ctypes, os, torch
from serving.models.layers import native
lib = native.load()
assert native.start_team(lib, 2, 1000, 7) == 2
fn = lib.kernels_team_check
fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
fn(50, torch.zeros(50, dtype=torch.int32).data_ptr(), torch.zeros(50, dtype=torch.int32).data_ptr(), 1000)
import time
deadline = time.monotonic() + 20  # a loaded machine may run the worker thread (which sets its nice) late
while True:
    nice = {}
    for tid in os.listdir("/proc/self/task"):
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        nice[int(tid)] = int(fields[16])  # field 19 of stat: nice
    if sorted(nice.values()).count(7) or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(nice[os.getpid()], sorted(nice.values()).count(7))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    caller, niced = map(int, out.stdout.split())
    assert caller == 0 and niced == 1, out.stdout  # one worker in a team of 2


def test_the_worker_nice_is_bounded():
    from serving.args import ServerArgs

    with pytest.raises(ValueError, match="kernel-worker-nice"):
        ServerArgs(model="tiny-random", kernel_worker_nice=20).validate()
