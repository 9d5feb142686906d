"""The request inspector's data: /debug/state, /debug/requests (recent, or in flight) and
/debug/requests/{rid}.  Behind several tokenizer workers each worker holds only its own
requests, so these ask the hub, which gathers every worker's answer.  /debug/timeline asks
every Scheduler rank for its recent steps (the replies come back through the hub to the
worker that asked) and merges them into one Chrome Trace Event file.  POST /debug/barrier
returns once a marker has been through every rank's Scheduler and Detokenizer and back
(`TokenizerManager.barrier`): what the engine sent before it, outputs and stats, has been
handled by then (behind several workers: by the hub, and on the asking worker's output path)."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.frontend.http.state import ServerState
from telemetry.step_timeline import chrome_trace

MAX_TIMELINE_SECONDS = 3600.0


async def debug_state(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.hub is not None:
        return _hub_json(await state.hub.query("debug_state"))
    return JSONResponse(state.debug_state())


async def debug_requests(request: Request) -> Response:
    """Recent finished requests, newest first; with `in_flight=1` the requests in flight, oldest first."""
    state: ServerState = request.app.state.server
    limit = int(request.query_params.get("limit", "100")) if request.query_params.get("limit", "").isdigit() else 100
    in_flight = request.query_params.get("in_flight", "").lower() in ("1", "true", "yes")
    if state.hub is not None:  # each worker holds its own requests: the hub asks them all
        return _hub_json(await state.hub.query("requests", json.dumps({"limit": limit, "in_flight": in_flight})))
    return JSONResponse({"requests": state.in_flight_requests(limit) if in_flight else state.timeline.recent(limit)})


async def debug_request(request: Request) -> Response:
    state: ServerState = request.app.state.server
    rid = request.path_params["rid"]
    if state.hub is not None:  # any worker may hold it; the hub also holds the engine's spans
        return _hub_json(await state.hub.query("request", rid))
    entry = state.timeline.get(rid)
    if entry is None:
        return JSONResponse(
            {
                "error": {
                    "message": f"no finished request {rid!r} in the timeline buffer",
                    "type": "not_found_error",
                    "param": "rid",
                    "code": None,
                }
            },
            status_code=404,
        )
    return JSONResponse(entry)


async def debug_timeline(request: Request) -> Response:
    """The engine steps of the last `seconds` (default 10) on every rank, as Chrome Trace Event JSON."""
    state: ServerState = request.app.state.server
    try:
        seconds = min(max(float(request.query_params.get("seconds", "10")), 0.0), MAX_TIMELINE_SECONDS)
    except ValueError:
        return JSONResponse(
            {
                "error": {
                    "message": "seconds must be a number",
                    "type": "invalid_request_error",
                    "param": "seconds",
                    "code": None,
                }
            },
            status_code=400,
        )
    try:
        replies = await state.tm.step_timeline(seconds)
    except TimeoutError:
        return _rank_unavailable()
    body = chrome_trace((r.dp_rank, r.steps) for r in replies)
    return JSONResponse(body, headers={"content-disposition": 'inline; filename="sightline-timeline.json"'})


async def debug_barrier(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        ranks = await state.tm.barrier()
    except TimeoutError:
        return _rank_unavailable()
    return JSONResponse({"ranks": ranks})


def _rank_unavailable() -> Response:
    return JSONResponse(
        {"error": {"message": "an engine rank did not answer", "type": "unavailable", "param": None, "code": None}},
        status_code=503,
    )


def _hub_json(reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type="application/json")
