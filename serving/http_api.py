"""The HTTP front: Starlette routes over the TokenizerManager.

    POST /v1/completions, /v1/chat/completions   OpenAI-compatible, stream or not
    POST /generate                               SGLang-style (text or input_ids)
    GET  /v1/models, /health, /debug/state

Every failure is an OpenAI-style JSON error with a 4xx/5xx status; a client that goes
away aborts its request down to the Scheduler (streaming: the SSE generator is
cancelled; non-streaming: a watcher on `http.disconnect`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.errors import APIError
from serving.generate_api import GenerateRequest, generate_input, generate_body
from serving.io_struct import StrOut
from serving.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, ResponseShape, chat_input, completion_input, decode_body,
    include_usage,
)
from serving.server_state import ServerState
from serving.tokenizer_manager import Collected, GenerateReqInput, ReqState

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(err.body()), status_code=err.status, media_type="application/json", headers=headers)


class SSEResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends, even if it never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_or_abort(request: Request, state: ServerState, req: ReqState) -> Collected | None:
    """Wait for the whole result; None (request aborted) if the client disconnects first."""
    work = asyncio.ensure_future(state.tm.collect(req))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            state.tm.abort(req.rid, "client_disconnect")
    return work.result() if work in done else None


def _result_error(result: Collected | StrOut) -> APIError | None:
    if result.finish_reason == "error":
        return APIError(500, result.error or "the engine failed this request", type="internal_error")
    return None


def _submit(state: ServerState, obj: GenerateReqInput) -> ReqState:
    state.check_available()
    return state.tm.submit(obj)


async def openai_endpoint(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.server
    body = decode_body(await request.body(), ChatCompletionRequest if chat else CompletionRequest)
    build = chat_input if chat else completion_input
    obj = build(body, state.model_name, state.args.max_stop_strings)
    req = _submit(state, obj)
    shape = ResponseShape(chat, req.rid, state.model_name, include_usage(body))
    headers = {"x-request-id": req.rid}
    if body.stream:
        return SSEResponse(_openai_events(state, req, shape), lambda: state.tm.abort(req.rid, "client_disconnect"),
                           headers)
    result = await collect_or_abort(request, state, req)
    if result is None:
        return Response(status_code=499)
    if (err := _result_error(result)) is not None:
        return error_response(err, headers)
    return JSONResponse(shape.full(result.text, result.finish_reason, result.prompt_tokens, result.completion_tokens),
                        headers=headers)


async def _openai_events(state: ServerState, req: ReqState, shape: ResponseShape) -> AsyncIterator[bytes]:
    if shape.chat:
        yield sse(shape.role_chunk())
    completion_tokens = 0
    async for out in state.tm.stream(req):
        completion_tokens = out.completion_tokens or completion_tokens
        if (err := _result_error(out)) is not None:
            yield sse(err.body())
            yield SSE_DONE
            return
        if out.text or out.finish_reason is not None:
            yield sse(shape.delta_chunk(out.text, out.finish_reason))
    if shape.with_usage:
        yield sse(shape.usage_chunk(req.prompt_tokens, completion_tokens))
    yield SSE_DONE


async def completions(request: Request) -> Response:
    return await openai_endpoint(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await openai_endpoint(request, chat=True)


async def generate(request: Request) -> Response:
    """SGLang's native endpoint: cumulative `text` and `output_ids` plus `meta_info`."""
    state: ServerState = request.app.state.server
    body = decode_body(await request.body(), GenerateRequest)
    req = _submit(state, generate_input(body, state.args.max_stop_strings))
    headers = {"x-request-id": req.rid}
    if body.stream:
        return SSEResponse(_generate_events(state, req), lambda: state.tm.abort(req.rid, "client_disconnect"), headers)
    result = await collect_or_abort(request, state, req)
    if result is None:
        return Response(status_code=499)
    if (err := _result_error(result)) is not None:
        return error_response(err, headers)
    return JSONResponse(generate_body(result), headers=headers)


async def _generate_events(state: ServerState, req: ReqState) -> AsyncIterator[bytes]:
    text, ids = [], []
    async for out in state.tm.stream(req):
        if (err := _result_error(out)) is not None:
            yield sse(err.body())
            break
        text.append(out.text)
        ids.extend(out.output_ids)
        yield sse(generate_body(Collected(req.rid, "".join(text), list(ids), out.finish_reason, out.matched_stop,
                                          req.prompt_tokens, out.completion_tokens, None)))
    yield SSE_DONE


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "sightline",
        "max_model_len": state.tm.context_len if state.tm.all_ready.is_set() else None,
    }]})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ok, reason = state.health()
    return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)


async def debug_state(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({**state.tm.debug_state(), **state.describe()})


async def _api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    msg = {404: f"no route for {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
    return error_response(APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)), type=kind),
                          headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(APIError(500, "internal server error", type="internal_error"))


def build_app(state: ServerState) -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/debug/state", debug_state, methods=["GET"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.server = state
    return app

