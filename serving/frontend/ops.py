"""Operational endpoints and HTTP accounting: /v1/models, /health, /livez, /metrics, /debug/*,
/flush_cache (their routes are in the app's one route table, `serving.frontend.app.ROUTES`);
the response counter and the `x-request-id`/`traceparent` every response carries.

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
from starlette.routing import BaseRoute, Match

from serving.frontend.errors import APIError, bad_request, error_response
from serving.frontend.http_server import id_headers
from serving.frontend.server_state import ServerState

# Label values come from bounded sets: anything else a client sends counts as "other".
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _engine_facts(state: ServerState) -> dict:
    """What the running engine computes with (null while it starts)."""
    ready = state.monitor.engine_ready
    return {"architecture": ready.architecture if ready else None,
            "max_model_len": ready.context_len if ready else None, "dtype": ready.dtype if ready else None,
            "quantization": ready.quantization if ready else None,
            "sliding_window": (ready.sliding_window or None) if ready else None}


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "sightline",
        **_engine_facts(state),
    }]})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ok, reason = state.health()
    if state.metrics is not None:
        state.metrics.health_checks.labels(str(ok).lower()).inc()
    return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)


async def livez(request: Request) -> Response:
    """Liveness: this HTTP process and its event loop answer. 200 always; it never looks at the
    engine, so neither a long forward step nor an engine restart fails it (/health says those)."""
    return JSONResponse({"status": "alive"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.metrics is None:
        return JSONResponse({"error": {"message": "metrics are disabled (--no-enable-metrics)", "type":
                                       "not_found_error", "param": None, "code": None}}, status_code=404)
    openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
    media_type = OPENMETRICS_TYPE if openmetrics else CONTENT_TYPE_LATEST
    if state.hub is not None:  # one of several workers: the hub merges every worker's numbers with the engine's
        return Response((await state.hub.query("metrics", "openmetrics" if openmetrics else "text")).body,
                        media_type=media_type)
    return Response((openmetrics_latest if openmetrics else generate_latest)(state.metrics.registry),
                    media_type=media_type)


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
        return JSONResponse({"error": {"message": f"no finished request {rid!r} in the timeline buffer",
                                       "type": "not_found_error", "param": "rid", "code": None}}, status_code=404)
    return JSONResponse(entry)


async def flush_cache(request: Request) -> Response:
    """Empty the prefix cache (SGLang's endpoint): 409 while requests run unless `{"force": true}`
    (then only the prefixes no running request reuses are dropped)."""
    state: ServerState = request.app.state.server
    try:
        force = _force_flag(await request.body(), request.query_params.get("force"))
        state.monitor.check_ready()
        try:
            reply = await state.tm.flush_cache(force)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer the flush request", type="server_unavailable") from None
        if not reply.success:
            disabled = "disabled" in reply.message
            raise APIError(400 if disabled else 409, reply.message, code="prefix_cache_disabled" if disabled
                           else "requests_running")
    except APIError as err:
        if state.metrics is not None:
            state.metrics.cache_flushes.labels(state.model_name, "refused" if err.status == 409 else "error").inc()
        return error_response(err)
    if state.metrics is not None:
        state.metrics.cache_flushes.labels(state.model_name, "ok").inc()
    return JSONResponse({"status": "ok", "flushed_tokens": reply.flushed_tokens})


def _hub_json(reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type="application/json")


def _force_flag(body: bytes, query: str | None) -> bool:
    """`force` from a JSON body (optional) or the query string."""
    if query is not None:
        return query.lower() in ("1", "true", "yes")
    if not body.strip():
        return False
    try:
        obj = json.loads(body)
    except ValueError:
        raise bad_request("the body must be JSON, e.g. {\"force\": true}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("force", False), bool):
        raise bad_request("`force` must be a boolean", param="force")
    return obj.get("force", False)


class HTTPMetricsMiddleware:
    """Counts every HTTP response by route template, method and status (pure ASGI: streams untouched)."""

    def __init__(self, app, state: ServerState, routes: list[BaseRoute]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    def route_of(self, scope) -> str:
        """The template of the route the request matches (even with a wrong method), else `unmatched`."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return "unmatched"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.state.metrics is None:
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope)
        counter = self.state.metrics.http_requests

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
                counter.labels(route, method, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


# -- x-request-id and traceparent on every response -------------------------------------
IDS_SCOPE_KEY = "sightline.response_ids"  # scope: this HTTP request's fallback (x-request-id, traceparent)


def response_ids(scope) -> list[tuple[bytes, bytes]]:
    """This HTTP request's own x-request-id and traceparent, made on first use and kept in the
    scope (the 500 handler, which runs outside the middleware stack, finds them there)."""
    ids = scope.get(IDS_SCOPE_KEY)
    if ids is None:
        incoming = next((v for k, v in scope["headers"] if k == b"traceparent"), b"")
        ids = scope[IDS_SCOPE_KEY] = id_headers(incoming.decode("latin-1"))
    return ids


class ResponseIdsMiddleware:
    """Every response carries `x-request-id` and `traceparent`, including those no handler
    made (401, 415, 404, 405, CORS preflights): a client can always quote one in a report.
    A generation handler sets its own (the rid; the server span's context when one was
    sampled); whichever of the two a response lacks gets this HTTP request's own."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_ids(message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers", ())
                have = {name.lower() for name, _ in headers}
                if b"x-request-id" not in have or b"traceparent" not in have:
                    message = {**message, "headers": [*headers, *((k, v) for k, v in response_ids(scope)
                                                                  if k not in have)]}
            await send(message)

        await self.app(scope, receive, send_with_ids)
