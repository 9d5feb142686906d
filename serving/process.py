"""What every child process does first: name itself, die with its parent, stop cleanly on SIGTERM.

Ctrl-C reaches the whole process group; children ignore SIGINT and let the main
process stop them in order (SIGTERM), so nothing is half torn down.  On Linux the
kernel also SIGKILLs a child whose parent dies (PR_SET_PDEATHSIG): no orphans even
when the main process is killed with -9.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import sys

from telemetry.logs import setup_logging

PR_SET_PDEATHSIG = 1
TITLE_PREFIX = "sightline::"


def set_title(role: str) -> None:
    """`sightline::<role>` in ps, top and /proc/<pid>/cmdline, so an operator tells the processes
    apart (they are all `python -c from multiprocessing.spawn ...` otherwise)."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # a pinned dependency; a title is not worth refusing to start over
        return
    setproctitle(TITLE_PREFIX + role)


_stop_requested = False


def _on_sigterm(_signum, _frame):
    # Only a flag: raising here could land in any frame (a destructor, a zmq call).
    global _stop_requested
    _stop_requested = True


def setup_child(role: str, args) -> int:
    """Prepare a spawned child; returns the parent pid to watch."""
    set_title(role)
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        raise SystemExit(0)
    setup_logging(role, args.log_level, args.log_format)
    return parent


def freeze_heap() -> None:
    """Once a process has loaded what it serves with (modules, weights, the tokenizer), move every
    object alive out of the cyclic collector's reach: no full collection walks them again while it
    serves, and the interpreter's last collection at exit skips them (a Scheduler's took about a
    second of its stop)."""
    gc.collect()
    gc.freeze()


STACK_SIGNAL = signal.SIGUSR2  # unused otherwise; faulthandler answers it in the engine's children
_stack_file = None


def stack_file(runtime_dir: str, pid: int) -> str:
    return os.path.join(runtime_dir, "stacks", f"{pid}.txt")


def enable_stack_dumps(runtime_dir: str) -> None:
    """On STACK_SIGNAL, write every thread's Python stack to `stack_file(runtime_dir, pid)`
    (faulthandler, in C: it answers even while the interpreter is stuck); crash dumps read it."""
    global _stack_file
    try:
        path = stack_file(runtime_dir, os.getpid())
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        _stack_file = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
    except (OSError, RuntimeError, ValueError):  # no stacks in crash dumps is no reason not to serve
        _stack_file = None


def keep_running(parent: int) -> bool:
    """False once SIGTERM arrived or the parent is gone; loops poll at most a heartbeat apart."""
    return not _stop_requested and os.getppid() == parent
