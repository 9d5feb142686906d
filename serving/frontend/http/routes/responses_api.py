"""OpenAI's Responses API over the chat pipeline.

    POST   /v1/responses                     create: the body becomes the chat request (responses_input), is
                                             admitted and answered like a chat completion, and its body or
                                             chunks are reshaped (responses_shapes); stored unless `store: false`
    GET    /v1/responses/{id}                a stored response
    DELETE /v1/responses/{id}                forget it
    GET    /v1/responses/{id}/input_items    its input items (`limit`, `order`, `after`)

A create request has the chat route's telemetry (span `POST /v1/responses`, histograms, the endings
table, Server-Timing, the flight recorder) since it is admitted by the same `admit`.  An unknown id is a
404 (400 naming `previous_response_id` in a create), in OpenAI's error shape.
"""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.frontend.errors import APIError, bad_request
from serving.frontend.http.routes.generation import Kind, admit
from serving.frontend.http.routes.openai_api import front_of
from serving.frontend.http.routes.openai_responses import Answer, chunks, collect, make_shape, stream
from serving.frontend.http.routes.responses_input import ROUTE, Turn, responses_error, responses_input, to_messages
from serving.frontend.http.routes.responses_requests import ResponsesRequest
from serving.frontend.http.routes.responses_shapes import EventStream, ResponseObject
from serving.frontend.http.routes.responses_store import StoredResponse
from serving.frontend.http.sse import sse
from serving.frontend.http.state import ServerState


def _build(body: ResponsesRequest, state: ServerState):
    previous = None
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise bad_request(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
    obj, body.turn = responses_input(body, front_of(state), previous)
    return obj


KIND = Kind(ResponsesRequest, "chat", ROUTE, _build, responses_error)


def _store(state: ServerState, turn: Turn, response: dict) -> None:
    if not turn.echo["store"]:
        return
    names = dict(turn.call_names)
    messages = turn.messages + to_messages(response["output"], names)
    state.responses.put(response["id"], StoredResponse(response, turn.items, messages, names))


async def create(request: Request) -> Response:
    state: ServerState = request.app.state.server
    got = await admit(request, KIND)
    if isinstance(got, Response):
        return got
    turn: Turn = got.body.turn
    answer = Answer(state, got.req, got.choices, make_shape(state, got.req, True, False, True, False))
    obj = ResponseObject(got.req.rid, state.model_name, turn.echo)
    if got.obj.stream:
        return stream(answer, _events(state, answer, obj, turn), got.headers, got.obj.timeout)
    chat = await collect(request, answer, got.headers)
    if isinstance(chat, Response):
        return chat
    response = obj.from_chat(chat)
    _store(state, turn, response)
    return JSONResponse(response, headers=got.headers)


async def _events(state: ServerState, answer: Answer, obj: ResponseObject, turn: Turn) -> AsyncIterator[bytes]:
    events = EventStream(obj)
    for ev in events.start():
        yield sse(ev)
    async for chunk in chunks(answer):
        for ev in events.chunk(chunk):
            yield sse(ev)
        if "error" in chunk:
            return
    for ev in events.end():
        yield sse(ev)
    _store(state, turn, events.final)


def _stored(request: Request) -> tuple[ServerState, str, StoredResponse]:
    state: ServerState = request.app.state.server
    rid = request.path_params["response_id"]
    entry = state.responses.get(rid)
    if entry is None:
        raise APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
    return state, rid, entry


async def retrieve(request: Request) -> Response:
    return JSONResponse(_stored(request)[2].response)


async def delete(request: Request) -> Response:
    state, rid, _ = _stored(request)
    state.responses.delete(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


async def input_items(request: Request) -> Response:
    """A stored response's input items, newest first unless `order=asc`; `after` an item id; `limit` 1-100."""
    items = list(_stored(request)[2].items)
    q = request.query_params
    order, raw_limit, after = q.get("order", "desc"), q.get("limit", "20"), q.get("after")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", param="order")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise bad_request("limit must be an integer in [1, 100]", param="limit")
    if order == "desc":
        items.reverse()
    ids = [it["id"] for it in items]
    if after is not None:
        if after not in ids:
            raise bad_request(f"after names no input item of this response: {after!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(raw_limit)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )
