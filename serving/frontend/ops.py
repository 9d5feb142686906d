"""Operational endpoints and HTTP accounting: /v1/models, /health, /metrics, /debug/*.

`/metrics` speaks OpenMetrics (with exemplars: trace ids on per-request histograms)
when the scraper asks for it, else the classic text format.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.frontend.server_state import ServerState

# Label values come from bounded sets: anything else a client sends counts as "other".
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
KNOWN_ROUTES = {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health", "/metrics",
                "/debug/state", "/debug/requests"}


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "sightline",
        "max_model_len": state.tm.context_len if state.tm.all_ready.is_set() else None,
    }]})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ok, reason = state.health()
    if state.metrics is not None:
        state.metrics.get("sightline_health_checks_total").labels(str(ok).lower()).inc()
    return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.metrics is None:
        return JSONResponse({"error": {"message": "metrics are disabled (--no-enable-metrics)", "type":
                                       "not_found_error", "param": None, "code": None}}, status_code=404)
    if "application/openmetrics-text" in request.headers.get("accept", ""):
        return Response(openmetrics_latest(state.metrics.registry), media_type=OPENMETRICS_TYPE)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def debug_state(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({**state.tm.debug_state(), **state.describe()})


async def debug_requests(request: Request) -> Response:
    state: ServerState = request.app.state.server
    limit = int(request.query_params.get("limit", "100")) if request.query_params.get("limit", "").isdigit() else 100
    return JSONResponse({"requests": state.timeline.recent(limit)})


async def debug_request(request: Request) -> Response:
    state: ServerState = request.app.state.server
    rid = request.path_params["rid"]
    entry = state.timeline.get(rid)
    if entry is None:
        return JSONResponse({"error": {"message": f"no finished request {rid!r} in the timeline buffer",
                                       "type": "not_found_error", "param": "rid", "code": None}}, status_code=404)
    return JSONResponse(entry)


OPS_ROUTES = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/debug/state", debug_state, methods=["GET"]),
    Route("/debug/requests", debug_requests, methods=["GET"]),
    Route("/debug/requests/{rid}", debug_request, methods=["GET"]),
]


class HTTPMetricsMiddleware:
    """Counts every HTTP response by route template, method and status (pure ASGI: streams untouched)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.state.metrics is None:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else ("/debug/requests/{rid}" if path.startswith("/debug/requests/")
                                                   else "unmatched")
        counter = self.state.metrics.get("sightline_http_requests_total")

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
                counter.labels(route, method, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
