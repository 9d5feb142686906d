"""Anthropic's Messages API over the chat pipeline:

    POST /v1/messages                 a message, streamed (Anthropic's events) or whole
    POST /v1/messages/count_tokens    `{"input_tokens"}` of the prompt the same body renders

The body becomes the chat route's request (`anthropic_api`), is admitted exactly as a chat request is
(`generation.admit`: the same checks, telemetry, flight record and Server-Timing), and its chat answer is
shaped as Anthropic's (`anthropic_shapes`).  Errors, before or during the answer, are in Anthropic's
shape (`{"type": "error", "error": {"type", "message"}}`) with the status the chat route would give.
"""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol.reasons import AbortReason
from serving.frontend.errors import CLIENT_GONE, APIError, error_response, result_error
from serving.frontend.http.disconnect import await_or_abort
from serving.frontend.http.routes.anthropic_api import COUNT_ROUTE, ROUTE, count_input, messages_input
from serving.frontend.http.routes.anthropic_requests import CountTokensRequest, MessagesRequest
from serving.frontend.http.routes.anthropic_shapes import MessageShape, content, error_event, stop_reason, usage
from serving.frontend.http.routes.generation import Kind, admit, read_body
from serving.frontend.http.routes.openai_api import decode_body, front_of
from serving.frontend.http.sse import SSEResponse
from serving.frontend.http.state import ServerState
from serving.frontend.output_parsing import OutputParsing
from serving.frontend.tokenizer_manager.req_state import ReqState
from serving.frontend.tokenizer_manager.tokenization import check_size
from telemetry.request_telemetry import server_timing

KIND = Kind(MessagesRequest, "chat", ROUTE, lambda b, s: messages_input(b, front_of(s)))


def _usage(req: ReqState) -> dict:
    return usage(req.prompt_tokens, req.cached_tokens, req.completion_tokens)


async def messages(request: Request) -> Response:
    state: ServerState = request.app.state.server
    got = await admit(request, KIND)
    if isinstance(got, Response):
        return got
    req, obj, headers, tel = got.req, got.obj, got.headers, state.tel
    shape = MessageShape(f"msg_{req.rid}", state.model_name, obj.stop)

    def abort() -> None:
        if not req.finished:
            state.tm.abort(req.rid, AbortReason.CLIENT_DISCONNECT)

    if obj.stream:

        def on_close() -> None:
            abort()
            tel.end(req, req.status)

        return SSEResponse(_events(state, req, shape), on_close, headers, obj.timeout)
    result = await await_or_abort(request, state.tm.collect(req), abort)
    if result is None:
        tel.end(req, CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    if (err := result_error(result.finish_reason, result.error, req.status)) is not None:
        tel.end(req, err.status)
        return error_response(err, headers, path=ROUTE)
    parsing = req.parsing if isinstance(req.parsing, OutputParsing) else None
    reason, sequence = stop_reason(req.finish_reason or result.finish_reason, result.matched_stop, obj.stop)
    body = shape.message(content(result.text, parsing.result if parsing else None), reason, sequence, _usage(req))
    body["sightline"] = req.breakdown
    if req.breakdown:
        headers["server-timing"] = server_timing(req.breakdown)
    tel.end(req, 200)
    return JSONResponse(body, headers=headers)


async def _events(state: ServerState, req: ReqState, shape: MessageShape) -> AsyncIterator[bytes]:
    yield shape.start(usage(req.prompt_tokens, 0, 0))
    parsing = req.parsing if isinstance(req.parsing, OutputParsing) else None
    matched = finish = None
    async for out in state.tm.stream(req):
        if (err := result_error(out.finish_reason, out.error, req.status)) is not None:
            yield error_event(err)
            return
        yield shape.delta(parsing.drain() if parsing is not None else {"content": out.text})
        matched, finish = out.matched_stop, out.finish_reason or finish
    reason, sequence = stop_reason(req.finish_reason or finish, matched, shape.stops)
    yield shape.finish(reason, sequence, _usage(req), req.breakdown)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the TokenizerManager would count them for the same body (its `usage.input_tokens`
    plus `cache_read_input_tokens`)."""
    state: ServerState = request.app.state.server
    try:
        body = decode_body(await read_body(request, state.args.max_request_bytes), CountTokensRequest)
        obj = count_input(body, front_of(state))
        ready = state.engine.engine_ready
        if ready is not None:
            check_size(obj, ready.context_len, state.tm.input_limits(ready))
        ids = await state.tm.prompts.encode(obj, len(state.tm.tokenizer))
    except APIError as err:
        return error_response(err, path=COUNT_ROUTE)
    return JSONResponse({"input_tokens": len(ids)})
