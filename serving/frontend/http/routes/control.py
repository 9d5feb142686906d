"""Operator controls: pause and resume generation, runtime tracing and log settings, the effective
configuration.

    POST /pause_generation     {"mode": "abort" | "in_place" | "drain"}  (default abort, as SGLang's)
    POST /continue_generation  resume whatever the pause stopped
    POST /control/tracing      {"sampling_ratio": 0.1}   head-sampling ratio of new traces
    POST /control/log_level    {"level": "debug"}        the main process's and every Scheduler rank's
    GET  /control/config       ServerArgs (secrets hidden), the OTEL_*/SIGHTLINE_* environment, runtime state

Pause modes (while any is in effect, /health and every new generation request answer 503
`paused`, the latter with Retry-After):

* `abort`: every request in flight ends at once with an explicit error (503; SSE: an error
  event and [DONE]), counted with outcome `aborted_by_operator`; its KV is freed.
* `in_place`: every Scheduler rank stops stepping; its requests keep their place and their
  KV, their streams stay open and get nothing until /continue_generation, after which they
  go on exactly where they were (a greedy request's tokens are those of an unpaused run).
  The call returns once every rank confirmed (its stats say so).
* `drain`: admission stops; requests in flight run to their end normally.

Pausing again while paused switches mode (drain → abort ends what is still running;
in_place → drain or abort lets the Scheduler step again first or aborts in place).
Deadlines keep running while paused (--request-timeout, --max-queue-time).

Each POST is logged (one INFO line: client, action, result), counted
(`sightline_control_actions_total{action, result}`) and the pause mode in effect is the
gauge `sightline_paused{mode}`; the Overview dashboard shows both as annotations.  Who may
call them is decided in `auth.py` (the API key, else loopback clients only).

Pause and resume are `serving.frontend.pause.PauseController`'s, driven here by `LocalPause`.
With several tokenizer workers (`--tokenizer-worker-num` > 1) the worker that takes the
POST checks its body and hands the action to the hub (`workers/control_relay.py`), which
owns the pause state (the same controller, its own driver), orders every worker (each
applies its part with `apply_order`: its own requests, tracer, log level, and the engine
messages to every rank) and answers once every worker and rank confirmed, or 503
`control_unconfirmed` naming those that did not.
`GET /control/config` is the answering worker's own view.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol.io_struct import ContinueReq, PauseReq, SetLogLevelReq
from protocol.reasons import AbortReason
from serving.frontend.errors import APIError, bad_request, error_response
from serving.frontend.http.state import ServerState
from serving.frontend.pause import CONFIRM_TIMEOUT, PauseController, PauseOrder, unconfirmed_ranks
from serving.ipc import engine_roles
from telemetry.metrics import PAUSE_MODES

log = logging.getLogger("sightline.control")
DEFAULT_MODE = "abort"  # SGLang's default
LOG_LEVELS = ("debug", "info", "warning", "error")
ABORT_MESSAGE = "the request was aborted by an operator (POST /pause_generation, mode abort)"
# names of settings whose values are never shown (the API key, OTLP headers carrying tokens...)
SECRET_NAME = re.compile(
    r"(^|_)(api_?key|key|secret|password|passwd|token|credentials?|headers?|authorization)$", re.IGNORECASE
)
URL_USERINFO = re.compile(r"(?<=//)[^/@\s]+@")
HIDDEN = "***"


# -- the endpoints ----------------------------------------------------------------------
Parse = Callable[[ServerState, dict], tuple[str, dict]]  # (action name, checked parameters), or APIError


async def _act(
    request: Request, name: str, parse: Parse, run: Callable[[ServerState, dict], Awaitable[dict]]
) -> Response:
    """One control action `name`: its body read and checked (`parse`, which may name the action more
    precisely), then `run` here, or with several workers by the hub over all of them; logged and
    counted either way ("pause" with no valid mode: logged only)."""
    state: ServerState = request.app.state.server
    try:
        name, params = parse(state, _body(await request.body()))
        result = await (run(state, params) if state.hub is None else _relay(state, name, params))
    except APIError as err:
        return _refused(request, state, name, err)
    _done(request, state, name, "ok", result)
    return JSONResponse({"status": "ok", **result})


async def _relay(state: ServerState, name: str, params: dict) -> dict:
    """The hub runs the action over every worker and rank; its error comes back as raised here."""
    reply = await state.hub.query("control", json.dumps({"action": name, **params}))
    body = json.loads(reply.body)
    if reply.status != 200:
        e = body["error"]
        raise APIError(reply.status, e["message"], type=e["type"], param=e["param"], code=e["code"])
    return body


def _parse_pause(state: ServerState, body: dict) -> tuple[str, dict]:
    mode = body.get("mode", DEFAULT_MODE)
    if mode not in PAUSE_MODES:
        raise bad_request(f"mode must be one of {', '.join(PAUSE_MODES)}", param="mode")
    return f"pause_{mode}", {"mode": mode}


def _parse_ratio(state: ServerState, body: dict) -> tuple[str, dict]:
    ratio = body.get("sampling_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise bad_request("sampling_ratio must be a number in [0, 1]", param="sampling_ratio")
    if state.tel.tracing.sampler is None:  # every worker runs with the same flags and environment
        raise APIError(
            409, "tracing is off in this server (--no-enable-tracing or OTEL_SDK_DISABLED)", code="tracing_disabled"
        )
    return "tracing", {"sampling_ratio": float(ratio)}


def _parse_level(state: ServerState, body: dict) -> tuple[str, dict]:
    level = body.get("level")
    if not isinstance(level, str) or level.lower() not in LOG_LEVELS:
        raise bad_request(f"level must be one of {', '.join(LOG_LEVELS)}", param="level")
    return "log_level", {"level": level.lower()}


async def pause_generation(request: Request) -> Response:
    return await _act(request, "pause", _parse_pause, lambda state, p: pause(state, p["mode"]))


async def continue_generation(request: Request) -> Response:
    return await _act(request, "continue", lambda state, body: ("continue", {}), lambda state, p: resume(state))


async def set_tracing(request: Request) -> Response:
    async def run(state: ServerState, p: dict) -> dict:
        return {"sampling_ratio": p["sampling_ratio"], "previous": _set_ratio(state, p["sampling_ratio"])}

    return await _act(request, "tracing", _parse_ratio, run)


async def set_log_level(request: Request) -> Response:
    async def run(state: ServerState, p: dict) -> dict:
        return {
            "level": p["level"],
            "previous": _set_level(state, p["level"]),
            "processes": ["main"] + engine_roles(state.args.dp_size)[:-1],
        }

    return await _act(request, "log_level", _parse_level, run)


def _set_ratio(state: ServerState, ratio: float) -> float:
    """This process's head-sampling ratio from now on; the previous one."""
    tracing = state.tel.tracing
    previous = tracing.sampling_ratio
    tracing.sampler.set_ratio(ratio)
    return previous


def _set_level(state: ServerState, level: str) -> str:
    """This process's root log level and every Scheduler rank's; the previous one here."""
    previous = logging.getLevelName(logging.getLogger().level).lower()
    logging.getLogger().setLevel(level.upper())
    state.tm.broadcast(SetLogLevelReq(level=level))
    return previous


async def config(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse(effective_config(state))


# -- what the actions do -------------------------------------------------------------------
class LocalPause:
    """The pause driver of a server that is its only tokenizer worker: its own requests and every rank."""

    unpause_first = False

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def state_changed(self) -> None:
        _show(self.state)

    async def apply(self, order: PauseOrder, what: str) -> dict:
        tm, aborted = self.state.tm, 0
        if order.abort:
            aborted = len(tm.rid_to_state)
            tm.abort_all(AbortReason.OPERATOR, ABORT_MESSAGE)
        if order.engine is not None:
            tm.broadcast(PauseReq(epoch=order.epoch) if order.engine == "pause" else ContinueReq())
            if await unconfirmed_ranks(self.state.monitor, order.epoch):
                raise APIError(
                    503,
                    f"the engine did not confirm the {what} within {CONFIRM_TIMEOUT:g} s; "
                    "admission stays as requested, retry to confirm",
                    type="server_unavailable",
                    code="control_unconfirmed",
                )
        return {"aborted": aborted, "in_flight": len(tm.rid_to_state)}


async def pause(state: ServerState, mode: str) -> dict:
    """Put the server in pause `mode` (see the module docstring); what it did, for the response."""
    return await PauseController(state.monitor, LocalPause(state)).pause(mode)


async def resume(state: ServerState) -> dict:
    return await PauseController(state.monitor, LocalPause(state)).resume()


def _show(state: ServerState) -> None:
    if state.metrics is not None:
        for mode in PAUSE_MODES:
            state.metrics.paused.labels(mode).set(1 if state.engine.paused == mode else 0)


# -- one worker's part of an action the hub relays -------------------------------------------
def apply_order(state: ServerState, order: dict) -> dict:
    """Apply the hub's order in this worker (the pause mode came just before, in the hub's status):
    ending its own requests (mode abort), the engine message to every rank (each worker sends it:
    a rank takes repeats of one pause epoch, a resume or a log level as one), its tracer and log level."""
    tm, out = state.tm, {}
    _show(state)
    if order.get("abort"):
        out["aborted"] = len(tm.rid_to_state)
        tm.abort_all(AbortReason.OPERATOR, ABORT_MESSAGE)
    if order.get("engine") == "pause":
        tm.broadcast(PauseReq(epoch=order["epoch"]))
    elif order.get("engine") == "continue":
        tm.broadcast(ContinueReq())
    if "sampling_ratio" in order:
        out["previous"] = _set_ratio(state, order["sampling_ratio"])
    if "level" in order:
        out["previous"] = _set_level(state, order["level"])
    out["in_flight"] = len(tm.rid_to_state)
    return out


# -- configuration view ---------------------------------------------------------------------
def hide(name: str, value):
    """A setting's value as shown: secrets hidden by name, credentials in URLs hidden."""
    if value is None:
        return None
    if SECRET_NAME.search(name):
        return HIDDEN
    if isinstance(value, str):
        return URL_USERINFO.sub(HIDDEN + "@", value)
    return value


def effective_config(state: ServerState) -> dict:
    args = {f.name: hide(f.name, getattr(state.args, f.name)) for f in dataclasses.fields(state.args)}
    env = {k: hide(k, v) for k, v in sorted(os.environ.items()) if k.startswith(("SIGHTLINE_", "OTEL_"))}
    return {
        "args": args,
        "environment": env,
        "runtime": {
            "paused": state.engine.paused,
            "sampling_ratio": state.tel.tracing.sampling_ratio,
            "log_level": logging.getLevelName(logging.getLogger().level).lower(),
            "tokenizer_worker": state.hub.worker if state.hub is not None else None,
        },
    }


# -- helpers ------------------------------------------------------------------------------------
def _body(raw: bytes) -> dict:
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except ValueError:
        raise bad_request("the body must be a JSON object", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return obj


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _count(state: ServerState, action: str, result: str) -> None:
    if state.metrics is not None and action != "pause":  # "pause": no valid mode was named (logged only)
        state.metrics.control_actions.labels(action, result).inc()


def _done(request: Request, state: ServerState, action: str, result: str, detail: dict) -> None:
    _count(state, action, result)
    log.info(
        "control %s by %s: %s %s",
        action,
        _client(request),
        result,
        json.dumps(detail, sort_keys=True),
        extra={"client": _client(request), "action": action, "result": result},
    )


def _refused(request: Request, state: ServerState, action: str, err: APIError) -> Response:
    result = "error" if err.status >= 500 else "rejected"
    _count(state, action, result)
    log.info(
        "control %s by %s: %s (%d %s)",
        action,
        _client(request),
        result,
        err.status,
        err.message,
        extra={"client": _client(request), "action": action, "result": result},
    )
    return error_response(err)
