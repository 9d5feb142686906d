"""`POST /debug/profile`: a py-spy profile of one live process of this server, which keeps serving.

    POST /debug/profile?process=scheduler&seconds=10&format=speedscope

* `process`: `main` (the process that owns the engine: the single front end, or the hub
  with several tokenizer workers), `scheduler` (`scheduler_dp<N>` with `--dp-size` > 1),
  `detokenizer`, and with several tokenizer workers `worker-<N>`: the names and pids
  `/debug/state` shows under `pids`.
* `seconds`: a whole number in [1, 60] (default 10); `format`: `speedscope` (JSON, the
  default), `flamegraph` (SVG), `raw` (collapsed stacks, text) or `chrometrace` (JSON);
  `rate`: samples per second in [1, 1000] (default 100); `idle=1` keeps idle threads' stacks.

py-spy runs as an asyncio subprocess (`py-spy record --nonblocking`: the target is never
paused) and the handler only awaits it, so the event loop keeps serving.  One profile at
a time per server: an exclusive `flock` on a file in the runtime directory, which every
tokenizer worker shares, so a second request, through any worker, gets 409 at once.
With several workers the worker that takes the request learns the pids from the hub
(its `/debug/state`) and runs py-spy itself; `main` is then the hub, the worker's parent.
py-spy must be able to read the target's memory (ptrace rights: root, CAP_SYS_PTRACE,
or `kernel.yama.ptrace_scope=0` for a same-user process); when it cannot, the 500 says
what py-spy said.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from serving.frontend.errors import APIError, bad_request, error_response
from serving.frontend.http.state import ServerState

MIN_SECONDS, MAX_SECONDS, DEFAULT_SECONDS = 1, 60, 10
MIN_RATE, MAX_RATE, DEFAULT_RATE = 1, 1000, 100
EXIT_SLACK = 15.0  # seconds py-spy may take past --duration to attach and write its file
OUTPUT_TAIL = 600  # characters of py-spy's own output quoted in an error
LOCK_NAME = "profile.lock"
FORMATS = {  # --format → (media type, file extension)
    "speedscope": ("application/json", "speedscope.json"),
    "flamegraph": ("image/svg+xml", "svg"),
    "raw": ("text/plain; charset=utf-8", "txt"),
    "chrometrace": ("application/json", "chrometrace.json"),
}
# py-spy's flamegraph SVG carries its own script: viewed in a browser it runs in an opaque
# origin (sandbox without allow-same-origin), so it can never read this server's pages.
_SVG_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; sandbox allow-scripts"


def py_spy_path() -> str | None:
    """py-spy from the server's own environment (the venv's bin, which need not be on PATH), else PATH."""
    here = Path(sys.executable).parent / "py-spy"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("py-spy")


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"`{name}` must be a whole number in [{lo}, {hi}], got {raw[:40]!r}", param=name) from None
    if not lo <= value <= hi:
        raise bad_request(f"`{name}` must be in [{lo}, {hi}], got {value}", param=name)
    return value


async def _pids(state: ServerState) -> dict[str, int]:
    """Every process a profile may target, by the name `/debug/state` gives it."""
    if state.hub is not None:  # a tokenizer worker: the engine's processes and the other workers are the hub's
        reply = await state.hub.query("debug_state")
        if reply.status != 200:
            raise APIError(503, "the hub could not list the server's processes", type="server_unavailable")
        hub_pid = os.getppid()  # a worker is the hub's child (and dies with it)
        return {**({"main": hub_pid} if hub_pid != 1 else {}), **json.loads(reply.body)["pids"]}
    procs = state.engine.procs
    return {"main": os.getpid(), **{role: p.pid for role, p in procs.items() if p.is_alive()}}


def _resolve(name: str, pids: dict[str, int], state: ServerState) -> int:
    if name in pids:
        return pids[name]
    if name == "scheduler":
        ranks = sorted(r for r in pids if r.startswith("scheduler_dp"))
        if ranks:
            raise bad_request(
                f"this server runs {len(ranks)} Scheduler ranks: name one of {', '.join(ranks)}",
                param="process",
                code="unknown_process",
            )
    known = (
        {"main", "detokenizer", "scheduler"}
        if state.args.dp_size == 1
        else {"main", "detokenizer", *(f"scheduler_dp{r}" for r in range(state.args.dp_size))}
    )
    if name in known:  # a child being replaced after an engine failure
        raise APIError(
            503,
            f"process {name!r} is not running right now (the engine is starting or restarting)",
            type="server_unavailable",
            param="process",
        )
    raise bad_request(
        f"unknown process {name[:64]!r}: one of {', '.join(sorted(pids))}", param="process", code="unknown_process"
    )


class _Lock:
    """One profile at a time over the whole server: an exclusive flock every worker shares."""

    def __init__(self, runtime_dir: str) -> None:
        self.path = os.path.join(runtime_dir, LOCK_NAME)
        self.fd: int | None = None

    def __enter__(self) -> _Lock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise APIError(
                409,
                "a profile is already running on this server; retry when it is done",
                type="invalid_request_error",
                code="profile_in_progress",
            ) from None
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing the descriptor releases the lock


async def _record(py_spy: str, pid: int, seconds: int, rate: int, fmt: str, idle: bool, out: str) -> bytes:
    cmd = [
        py_spy,
        "record",
        "--nonblocking",
        "--pid",
        str(pid),
        "--duration",
        str(seconds),
        "--rate",
        str(rate),
        "--format",
        fmt,
        "--output",
        out,
    ]
    if idle:
        cmd.append("--idle")
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        said, _ = await asyncio.wait_for(proc.communicate(), seconds + EXIT_SLACK)
    except BaseException:  # a timeout, or the handler cancelled: py-spy must not outlive the request
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    text = said.decode(errors="replace").strip()
    if proc.returncode != 0 or not os.path.exists(out):
        raise APIError(
            500,
            f"py-spy failed on pid {pid} (exit {proc.returncode}): {text[-OUTPUT_TAIL:]}",
            type="internal_error",
            code="profiler_failed",
        )
    with open(out, "rb") as f:
        return f.read()


async def debug_profile(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        q = request.query_params
        name = q.get("process", "")
        if not name:
            raise bad_request(
                "`process` is required: main, scheduler, detokenizer (see `pids` in /debug/state)", param="process"
            )
        seconds = _int_param(request, "seconds", DEFAULT_SECONDS, MIN_SECONDS, MAX_SECONDS)
        rate = _int_param(request, "rate", DEFAULT_RATE, MIN_RATE, MAX_RATE)
        fmt = q.get("format", "speedscope")
        if fmt not in FORMATS:
            raise bad_request(f"`format` must be one of {', '.join(FORMATS)}, got {fmt[:40]!r}", param="format")
        idle = q.get("idle", "").lower() in ("1", "true", "yes")
        py_spy = py_spy_path()
        if py_spy is None:
            raise APIError(
                501,
                "profiling needs py-spy, which is not installed here (pip install py-spy; "
                "it is a dependency of sightline)",
                type="not_implemented",
                code="profiler_missing",
            )
        pid = _resolve(name, await _pids(state), state)
        out = os.path.join(state.endpoints.runtime_dir, f"profile-{uuid.uuid4().hex}.{FORMATS[fmt][1]}")
        with _Lock(state.endpoints.runtime_dir):
            try:
                body = await _record(py_spy, pid, seconds, rate, fmt, idle, out)
            except asyncio.TimeoutError:
                raise APIError(
                    504,
                    f"py-spy did not finish within {seconds + EXIT_SLACK:g} s",
                    type="timeout",
                    code="profiler_timeout",
                ) from None
            finally:
                if os.path.exists(out):
                    os.unlink(out)
    except APIError as err:
        return error_response(err)
    media, ext = FORMATS[fmt]
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    headers = {
        "content-disposition": f'inline; filename="sightline-{name}-{pid}-{stamp}.{ext}"',
        "cache-control": "no-store",
        "x-content-type-options": "nosniff",
    }
    if fmt == "flamegraph":
        headers["content-security-policy"] = _SVG_CSP
    return Response(body, media_type=media, headers=headers)
