"""The Starlette app: one route table, the error handlers, the middleware stack."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from serving.frontend.errors import APIError, error_response
from serving.frontend.http.middleware.auth import AuthMiddleware
from serving.frontend.http.middleware.guard import GuardMiddleware, allowed_hosts, allowed_origins
from serving.frontend.http.middleware.http_metrics import HTTPMetricsMiddleware
from serving.frontend.http.middleware.response_ids import ResponseIdsMiddleware, response_ids
from serving.frontend.http.routes import control, debug, ops, responses_api, tokenize_api
from serving.frontend.http.routes.embeddings import embeddings, encode
from serving.frontend.http.routes.generation import chat_completions, completions, generate
from serving.frontend.http.routes.inspector import debug_ui
from serving.frontend.http.routes.messages import count_tokens, messages
from serving.frontend.http.routes.profiling import debug_profile
from serving.frontend.http.routes.rerank import rerank, score
from serving.frontend.http.state import ServerState

log = logging.getLogger(__name__)

ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/generate", generate, methods=["POST"]),
    Route("/v1/responses", responses_api.create, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses_api.retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses_api.delete, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", responses_api.input_items, methods=["GET"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/encode", encode, methods=["POST"]),
    *(Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
    *(Route(path, score, methods=["POST"]) for path in ("/v1/score", "/score")),
    Route("/v1/models", ops.models, methods=["GET"]),
    Route("/tokenize", tokenize_api.tokenize, methods=["POST"]),
    Route("/v1/tokenize", tokenize_api.tokenize, methods=["POST"]),
    Route("/detokenize", tokenize_api.detokenize, methods=["POST"]),
    Route("/v1/detokenize", tokenize_api.detokenize, methods=["POST"]),
    Route("/version", tokenize_api.version, methods=["GET"]),
    Route("/tokenizer_info", tokenize_api.tokenizer_info, methods=["GET"]),
    Route("/health", ops.health, methods=["GET"]),
    Route("/livez", ops.livez, methods=["GET"]),
    Route("/metrics", ops.metrics, methods=["GET"]),
    Route("/debug/state", debug.debug_state, methods=["GET"]),
    Route("/debug/requests", debug.debug_requests, methods=["GET"]),
    Route("/debug/requests/{rid}", debug.debug_request, methods=["GET"]),
    Route("/debug/timeline", debug.debug_timeline, methods=["GET"]),
    Route("/debug/barrier", debug.debug_barrier, methods=["POST"]),
    Route("/debug/profile", debug_profile, methods=["POST"]),
    Route("/debug/ui", debug_ui, methods=["GET"]),
    Route("/flush_cache", ops.flush_cache, methods=["POST"]),
    Route("/pause_generation", control.pause_generation, methods=["POST"]),
    Route("/continue_generation", control.continue_generation, methods=["POST"]),
    Route("/control/tracing", control.set_tracing, methods=["POST"]),
    Route("/control/log_level", control.set_log_level, methods=["POST"]),
    Route("/control/config", control.config, methods=["GET"]),
]


async def _api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc, path=request.url.path)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    msg = {
        404: f"no route for {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    return error_response(
        APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)), type=kind),
        headers=getattr(exc, "headers", None),
        path=request.url.path,
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Runs outside the middleware stack (Starlette's ServerErrorMiddleware), so the response ids
    are added here."""
    log.exception("unhandled error on %s", request.url.path)
    return error_response(
        APIError(500, "internal server error", type="internal_error"),
        headers={k.decode(): v.decode() for k, v in response_ids(request.scope)},
        path=request.url.path,
    )


def _cors(args) -> list[Middleware]:
    """CORS only where `--allowed-origins` opts in. Outside auth: a preflight carries no key, and a
    page must be able to read a 401. Private-network preflights (a public page calling a loopback
    or LAN server) are approved for the same origins: naming them is the opt-in."""
    origins = allowed_origins(args.allowed_origins)
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=("GET", "POST", "DELETE"),
            allow_headers=("*",),
            expose_headers=("x-request-id", "traceparent", "retry-after"),
            allow_private_network=True,
        )
    ]


def build_app(state: ServerState) -> Starlette:
    app = Starlette(
        routes=ROUTES,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        middleware=[
            Middleware(HTTPMetricsMiddleware, state=state, routes=ROUTES),
            Middleware(ResponseIdsMiddleware),
            *_cors(state.args),
            Middleware(GuardMiddleware, hosts=allowed_hosts(state.args.host, state.args.allowed_hosts)),
            Middleware(AuthMiddleware, args=state.args, keys=state.keys),
        ],
    )
    app.state.server = state
    return app
