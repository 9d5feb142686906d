"""The embeddings endpoints: decode the body → submit → wait for the vectors; telemetry around it.

    POST /v1/embeddings   OpenAI-compatible: `input` a string, a list of strings, a list of token ids or a
                          list of them; `encoding_format` float | base64; `dimensions`; usage.  Extensions as
                          vLLM / SGLang accept them: `normalize`, `truncate_prompt_tokens`, `priority`,
                          `cache_salt`, `rid`.
    POST /encode          SGLang's native route: `text` (a string or a list) or `input_ids` (a list, or a list
                          of lists); one `{"embedding", "meta_info"}` per input (a list when the input was).

A server not serving embeddings answers 400 `embeddings_not_supported`
(serving.frontend.tokenizer_manager.embeddings).  `embeddings_endpoint` is the one request path of
every route that embeds (rerank and score too, `routes/rerank.py`): a route brings its body's type, how
the body becomes an `EmbedReqInput`, and how the vectors become its answer.
"""

from __future__ import annotations

import base64
from typing import Any, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol.io_struct import EmbeddingOut
from protocol.reasons import AbortReason
from serving.frontend.errors import CLIENT_GONE, APIError, bad_request, error_response
from serving.frontend.http.disconnect import await_or_abort
from serving.frontend.http.middleware.auth import principal_of
from serving.frontend.http.routes.generation import read_body, request_timeout
from serving.frontend.http.routes.openai_api import decode_body
from serving.frontend.http.state import ServerState
from serving.frontend.tokenizer_manager import embeddings as tm_embeddings
from serving.frontend.tokenizer_manager.embeddings import EMBEDDINGS, EmbedReqInput, finish_vectors
from serving.frontend.tokenizer_manager.req_state import ReqState
from telemetry.clock import now_ns
from telemetry.request_telemetry import server_timing


class PoolingExtensions(msgspec.Struct, kw_only=True):
    """vLLM's / SGLang's fields every embedding route accepts."""

    truncate_prompt_tokens: int | None = None
    priority: int | None = None
    cache_salt: str | None = None
    rid: str | None = None


class _Extensions(PoolingExtensions, kw_only=True):
    normalize: bool | None = None


class EmbeddingRequest(_Extensions, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


class EncodeRequest(_Extensions, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None


def input_list(value: Any, param: str) -> tuple[list, bool]:
    """(the inputs, whether the client sent a list of them) for each accepted form, else a 400."""
    if isinstance(value, str):
        return [value], False
    if not isinstance(value, list) or not value:
        raise bad_request(
            f"{param} must be a string, a list of strings, a list of token ids or a list of them",
            param=param,
            code="invalid_type",
        )
    if all(isinstance(v, str) for v in value):
        return value, True
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value], False
    if all(isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v) for v in value):
        return value, True
    raise bad_request(
        f"{param} mixes forms: give strings, or token ids, or lists of token ids", param=param, code="invalid_type"
    )


def check_model(model: str | None, state: ServerState) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            400,
            f"The model `{model}` does not exist; this server serves `{state.model_name}`",
            param="model",
            code="model_not_found",
        )


def openai_input(body: EmbeddingRequest, state: ServerState) -> tuple[EmbedReqInput, bool]:
    check_model(body.model, state)
    if body.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be float or base64", param="encoding_format")
    inputs, _ = input_list(body.input, "input")
    return EmbedReqInput(
        inputs,
        "input",
        body.normalize,
        body.dimensions,
        body.truncate_prompt_tokens,
        body.rid,
        body.cache_salt,
        body.priority,
        body.user,
        encoding_format=body.encoding_format,
    ), True


def encode_input(body: EncodeRequest, state: ServerState) -> tuple[EmbedReqInput, bool]:
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", param="text")
    param = "text" if body.text is not None else "input_ids"
    inputs, many = input_list(body.text if body.text is not None else body.input_ids, param)
    return EmbedReqInput(
        inputs, param, body.normalize, None, body.truncate_prompt_tokens, body.rid, body.cache_salt, body.priority
    ), many


# (body, state) → (the request, what the answer needs besides the vectors); raises APIError for a bad body
Build = Callable[[Any, ServerState], tuple[EmbedReqInput, Any]]
# (the engine's result, the request, what `Build` returned beside it, the request's state, state) → JSON body
Respond = Callable[[EmbeddingOut, EmbedReqInput, Any, ReqState, ServerState], Any]


async def embeddings_endpoint(request: Request, route: str, typ: type, build: Build, respond: Respond) -> Response:
    state: ServerState = request.app.state.server
    tel = state.tel
    req = ReqState(route=route, operation=EMBEDDINGS, arrival=now_ns(), tenant=principal_of(request.scope).tenant)
    tel.begin(req, request.headers, "POST", {"sightline.tenant": req.tenant})
    try:
        body = decode_body(await read_body(request, state.args.max_request_bytes), typ)
        obj, extra = build(body, state)
        if tel.recorder is not None:
            req.trace.dump_input = obj
        obj.timeout = request_timeout(request, state.args.request_timeout)
        if req.trace.span is not None and obj.user is not None:
            req.trace.span.set_attribute("user.id", obj.user)
        await state.tm.submit_embeddings(obj, req)
    except APIError as err:
        tel.rejected(req, err.status, err.code or err.type, err.message, client_gone=err.status == CLIENT_GONE)
        return error_response(err, tel.response_headers(req))
    except Exception:
        tel.rejected(req, 500, "internal", "unhandled error", client_gone=False)
        raise
    headers = {"x-request-id": req.rid, **tel.response_headers(req)}
    result = await await_or_abort(
        request,
        tm_embeddings.collect(state.tm.stream(req), req),
        lambda: state.tm.abort(req.rid, AbortReason.CLIENT_DISCONNECT),
    )
    if result is None:
        tel.end(req, CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    out, err = result
    if err is not None:
        tel.end(req, err.status)
        return error_response(err, headers)
    result = respond(out, obj, extra, req, state)
    if req.breakdown:
        headers["server-timing"] = server_timing(req.breakdown)
    tel.end(req, 200)
    return JSONResponse(result, headers=headers)


def usage_of(out: EmbeddingOut) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}


def openai_result(out: EmbeddingOut, obj: EmbedReqInput, _: Any, req: ReqState, state: ServerState) -> dict:
    vectors = finish_vectors(out, obj.dimensions, bool(obj.normalize))
    b64 = obj.encoding_format == "base64"
    return {
        "object": "list",
        "model": state.model_name,
        "usage": usage_of(out),
        "sightline": req.breakdown,
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ],
    }


def encode_result(out: EmbeddingOut, obj: EmbedReqInput, many: bool, req: ReqState, _: ServerState) -> Any:
    meta = {
        "id": req.client_rid,
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.cached_tokens,
        "sightline": req.breakdown,
    }
    items = [{"embedding": v.tolist(), "meta_info": meta} for v in finish_vectors(out, None, bool(obj.normalize))]
    return items if many else items[0]


async def embeddings(request: Request) -> Response:
    return await embeddings_endpoint(request, "/v1/embeddings", EmbeddingRequest, openai_input, openai_result)


async def encode(request: Request) -> Response:
    """SGLang's native embeddings route."""
    return await embeddings_endpoint(request, "/encode", EncodeRequest, encode_input, encode_result)
