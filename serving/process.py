"""What every child process does first: name itself, die with its parent, stop cleanly on SIGTERM.

Ctrl-C reaches the whole process group; children ignore SIGINT and let the main
process stop them in order (SIGTERM), so nothing is half torn down.  On Linux the
kernel also SIGKILLs a child whose parent dies (PR_SET_PDEATHSIG): no orphans even
when the main process is killed with -9.
"""

from __future__ import annotations

import ctypes
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


def _on_sigterm(signum, frame):  # noqa: ARG001
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


def keep_running(parent: int) -> bool:
    """False once SIGTERM arrived or the parent is gone; loops poll at most a heartbeat apart."""
    return not _stop_requested and os.getppid() == parent
