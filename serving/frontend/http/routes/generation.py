"""The generation endpoints: decode the body → submit → stream SSE or collect; telemetry around it.

    POST /v1/completions, /v1/chat/completions   OpenAI-compatible, stream or not
    POST /generate                               SGLang-style (text or input_ids)

`admit` (decode, build, submit, with the request's telemetry begun) is shared with /v1/responses
(routes/responses_api.py), which answers from the same choices in its own shapes.

Every failure is an OpenAI-style JSON error with a 4xx/5xx status (the status a request
ends with is `errors.http_status`); a client that goes away aborts its request down to
the Scheduler (streaming: the SSE generator is cancelled; non-streaming: a watcher on
`http.disconnect`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from protocol.reasons import AbortReason
from serving.frontend.errors import CLIENT_GONE, APIError, error_response, result_error
from serving.frontend.http.disconnect import await_or_abort
from serving.frontend.http.middleware.auth import principal_of
from serving.frontend.http.routes.choices import Choice, submit_choices
from serving.frontend.http.routes.generate_api import GenerateRequest, generate_body, generate_input
from serving.frontend.http.routes.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    completion_input,
    continuous_usage,
    decode_body,
    front_of,
    include_usage,
)
from serving.frontend.http.routes.openai_responses import Answer, make_shape, respond
from serving.frontend.http.sse import SSE_DONE, SSEResponse, sse
from serving.frontend.http.state import ServerState
from serving.frontend.tokenizer_manager.req_state import Collected, GenerateReqInput, ReqState
from telemetry.clock import now_ns
from telemetry.request_slo import Objectives, SLOHeaderError, parse_headers
from telemetry.request_telemetry import server_timing


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing one larger than `limit` before reading it all (413) and one not in
    within `--body-read-timeout` (408: a slow or stuck client holds no connection forever);
    a client gone mid-upload is a client abort (499), not a server error."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    timeout = request.app.state.server.args.body_read_timeout
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None
    except ClientDisconnect:
        raise APIError(
            499, "the client disconnected while sending the request body", code="client_disconnect"
        ) from None
    return b"".join(chunks)


def request_timeout(request: Request, default: float | None) -> float | None:
    """The server's deadline, lowered (never raised) by an `x-request-timeout: SECONDS` header."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise APIError(400, "x-request-timeout must be a number of seconds in (0, 86400]", param="x-request-timeout")
    return min(value, default) if default else value


def request_objectives(request: Request, tenant: Objectives | None) -> Objectives | None:
    """The request's latency objectives: its SLO headers (telemetry/request_slo.py), each one it does not
    set taken from its tenant's; a malformed header is a 400 that names it."""
    try:
        own = parse_headers(request.headers)
    except SLOHeaderError as exc:
        raise APIError(400, str(exc), param=exc.header, code="invalid_slo_header") from None
    return own.over(tenant) or None


@dataclass(frozen=True)
class Kind:
    body: type
    operation: str  # gen_ai.operation.name
    route: str
    build: Callable
    errors: Callable[[APIError], APIError] | None = None  # a refusal as the route's API names it


KINDS = {
    "chat": Kind(ChatCompletionRequest, "chat", "/v1/chat/completions", lambda b, s: chat_input(b, front_of(s))),
    "completion": Kind(
        CompletionRequest, "text_completion", "/v1/completions", lambda b, s: completion_input(b, front_of(s))
    ),
    "generate": Kind(GenerateRequest, "generate", "/generate", lambda b, s: generate_input(b, front_of(s))),
}


def _request_attributes(obj: GenerateReqInput) -> dict:
    sp = obj.sampling
    attrs = {
        "gen_ai.request.temperature": sp.temperature,
        "gen_ai.request.top_p": sp.top_p,
        "gen_ai.request.stream": obj.stream,
    }
    if obj.max_new_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = obj.max_new_tokens
    if sp.seed is not None:
        attrs["gen_ai.request.seed"] = sp.seed
    if obj.user is not None:
        attrs["user.id"] = obj.user
    if obj.ignored_fields:  # unknown body fields accepted under --allow-unknown-fields
        attrs["sightline.ignored_fields"] = list(obj.ignored_fields)
    for name, source in obj.param_sources.items():  # request | generation_config | default
        attrs[f"sightline.param_source.{name}"] = source
    return attrs


@dataclass
class Admitted:
    """A generation request past every check and submitted: what its response is built from."""

    req: ReqState
    body: Any  # the decoded body (`Kind.body`)
    obj: GenerateReqInput
    choices: list[Choice]  # empty on /generate (the request itself is submitted)
    headers: dict[str, str]  # x-request-id and traceparent


async def admit(request: Request, kind: Kind) -> Admitted | Response:
    """Decode → build → submit, telemetry opened around it; a refusal is the error response (in the
    route's own error shape), counted once."""
    state: ServerState = request.app.state.server
    tel = state.tel
    req = ReqState(
        route=kind.route, operation=kind.operation, arrival=now_ns(), tenant=principal_of(request.scope).tenant
    )
    tel.begin(req, request.headers, "POST", {"sightline.tenant": req.tenant})
    choices: list[Choice] = []
    try:
        req.slo = request_objectives(request, state.keys.policy(req.tenant).objectives if state.keys else None)
        body = decode_body(await read_body(request, state.args.max_request_bytes), kind.body)
        obj = kind.build(body, state)
        if tel.recorder is not None:  # the flight recorder: prompt and sampling as run, read when it ends
            req.trace.dump_input = obj
        obj.timeout = request_timeout(request, state.args.request_timeout)
        req.stream = obj.stream
        if req.trace.span is not None:
            req.trace.span.set_attributes(_request_attributes(obj))
        if kind.route == "/generate":
            await state.tm.submit(obj, req)
        else:
            if obj.n > 1 or obj.batch is not None:  # several choices: this request is their HTTP parent
                req.rid = req.client_rid = uuid.uuid4().hex
            choices = await submit_choices(state, req, obj)
    except APIError as err:
        err = kind.errors(err) if kind.errors is not None else err
        tel.rejected(req, err.status, err.code or err.type, err.message, client_gone=err.status == CLIENT_GONE)
        return error_response(err, tel.response_headers(req), path=kind.route)
    except Exception:
        tel.rejected(req, 500, "internal", "unhandled error", client_gone=False)
        raise
    return Admitted(req, body, obj, choices, {"x-request-id": req.rid, **tel.response_headers(req)})


async def generation(request: Request, kind: Kind) -> Response:
    """Every generation endpoint of the OpenAI and SGLang shapes: admit, then stream or collect."""
    state: ServerState = request.app.state.server
    tel = state.tel
    got = await admit(request, kind)
    if isinstance(got, Response):
        return got
    req, body, obj, choices, headers = got.req, got.body, got.obj, got.choices, got.headers
    if kind.route != "/generate":
        shape = make_shape(
            state,
            req,
            kind.operation == "chat",
            obj.sampling.logprobs is not None or obj.sampling.prompt_logprobs is not None,
            include_usage(body),
            continuous_usage(body),
        )
        return await respond(request, Answer(state, req, choices, shape), headers, obj.stream, obj.timeout)
    if obj.stream:

        def on_close() -> None:
            state.tm.abort(req.rid, AbortReason.CLIENT_DISCONNECT)
            tel.end(req)

        return SSEResponse(_generate_events(state, req), on_close, headers, obj.timeout)
    result = await await_or_abort(
        request, state.tm.collect(req), lambda: state.tm.abort(req.rid, AbortReason.CLIENT_DISCONNECT)
    )
    if result is None:
        tel.end(req, CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    if (err := result_error(result.finish_reason, result.error, req.status)) is not None:
        tel.end(req, err.status)
        return error_response(err, headers)
    out = generate_body(result)
    out["meta_info"]["sightline"] = req.breakdown
    if req.breakdown:
        headers["server-timing"] = server_timing(req.breakdown)
    tel.end(req, 200)
    return JSONResponse(out, headers=headers)


async def _generate_events(state: ServerState, req: ReqState) -> AsyncIterator[bytes]:
    text, ids = [], []
    async for out in state.tm.stream(req):
        if (err := result_error(out.finish_reason, out.error, req.status)) is not None:
            yield sse(err.body())
            break
        text.append(out.text)
        ids.extend(out.output_ids)
        body = generate_body(
            Collected(
                req.client_rid,
                "".join(text),
                list(ids),
                out.finish_reason,
                out.matched_stop,
                req.prompt_tokens,
                out.completion_tokens,
                None,
                req.cached_tokens,
            )
        )
        if out.finish_reason is not None and req.breakdown:
            body["meta_info"]["sightline"] = req.breakdown
        yield sse(body)
    yield SSE_DONE


async def completions(request: Request) -> Response:
    return await generation(request, KINDS["completion"])


async def chat_completions(request: Request) -> Response:
    return await generation(request, KINDS["chat"])


async def generate(request: Request) -> Response:
    """SGLang's native endpoint: cumulative `text` and `output_ids` plus `meta_info`."""
    return await generation(request, KINDS["generate"])
