"""Operational endpoints: /v1/models, /health, /livez, /metrics, /flush_cache (their routes are in
the app's one route table, `serving.frontend.http.app.ROUTES`).

`/metrics` speaks OpenMetrics (with exemplars: trace ids on per-request histograms)
when the scraper asks for it, else the classic text format.
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.frontend.engine_state import require_engine
from serving.frontend.errors import APIError, bad_request, error_response
from serving.frontend.http.state import ServerState
from telemetry.clock import now_ns


def _engine_facts(state: ServerState) -> dict:
    """What the running engine computes with (null while it starts)."""
    ready = state.engine.engine_ready
    return {
        "architecture": ready.architecture if ready else None,
        "max_model_len": ready.context_len if ready else None,
        "dtype": ready.dtype if ready else None,
        "quantization": ready.quantization if ready else None,
        "sliding_window": (ready.sliding_window or None) if ready else None,
    }


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": int(state.started_at),
                    "owned_by": "sightline",
                    **_engine_facts(state),
                }
            ],
        }
    )


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ok, reason = state.health()
    if state.metrics is not None:
        state.metrics.health_checks.labels(str(ok).lower()).inc()
    return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)


async def livez(request: Request) -> Response:
    """Liveness: 200 while this HTTP process and its event loop answer, whatever the engine is doing
    (a long forward step or a restart fails /health only).  503 once the restart budget has been
    spent for `--liveness-down-grace` seconds: nothing in the server brings the engine back, so
    the orchestrator must restart it."""
    state: ServerState = request.app.state.server
    grace, down_at = state.args.liveness_down_grace, state.engine.down_at
    if grace >= 0 and down_at is not None and (now_ns() - down_at) / 1e9 >= grace:
        _, reason = state.health()
        return JSONResponse({"status": "dead", "reason": reason}, status_code=503)
    return JSONResponse({"status": "alive"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.metrics is None:
        return JSONResponse(
            {
                "error": {
                    "message": "metrics are disabled (--no-enable-metrics)",
                    "type": "not_found_error",
                    "param": None,
                    "code": None,
                }
            },
            status_code=404,
        )
    openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
    media_type = OPENMETRICS_TYPE if openmetrics else CONTENT_TYPE_LATEST
    if state.hub is not None:  # one of several workers: the hub merges every worker's numbers with the engine's
        return Response(
            (await state.hub.query("metrics", "openmetrics" if openmetrics else "text")).body, media_type=media_type
        )
    return Response(
        (openmetrics_latest if openmetrics else generate_latest)(state.metrics.registry), media_type=media_type
    )


async def flush_cache(request: Request) -> Response:
    """Empty the prefix cache (SGLang's endpoint): 409 while requests run unless `{"force": true}`
    (then only the prefixes no running request reuses are dropped)."""
    state: ServerState = request.app.state.server
    try:
        force = _force_flag(await request.body(), request.query_params.get("force"))
        require_engine(state.engine)
        try:
            reply = await state.tm.flush_cache(force)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer the flush request", type="server_unavailable") from None
        if not reply.success:
            disabled = "disabled" in reply.message
            raise APIError(
                400 if disabled else 409,
                reply.message,
                code="prefix_cache_disabled" if disabled else "requests_running",
            )
    except APIError as err:
        if state.metrics is not None:
            state.metrics.cache_flushes.labels(state.model_name, "refused" if err.status == 409 else "error").inc()
        return error_response(err)
    if state.metrics is not None:
        state.metrics.cache_flushes.labels(state.model_name, "ok").inc()
    return JSONResponse({"status": "ok", "flushed_tokens": reply.flushed_tokens})


def _force_flag(body: bytes, query: str | None) -> bool:
    """`force` from a JSON body (optional) or the query string."""
    if query is not None:
        return query.lower() in ("1", "true", "yes")
    if not body.strip():
        return False
    try:
        obj = json.loads(body)
    except ValueError:
        raise bad_request('the body must be JSON, e.g. {"force": true}') from None
    if not isinstance(obj, dict) or not isinstance(obj.get("force", False), bool):
        raise bad_request("`force` must be a boolean", param="force")
    return obj.get("force", False)
