"""The answer of /v1/completions and /v1/chat/completions once its choices are submitted
(`choices.submit_choices`): an SSE stream whose chunks name their choice, or one JSON body.
/v1/responses reads the same chunks (`chunks`) and body (`collect`) and reshapes them
(routes/responses_shapes.py).

Any choice that ends in an error ends the whole response with that error (its siblings are
aborted), as vLLM does; a client that goes away aborts every choice.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol.io_struct import StrOut
from protocol.reasons import AbortReason
from serving.frontend.errors import CLIENT_GONE, error_response, result_error
from serving.frontend.http.disconnect import await_or_abort
from serving.frontend.http.routes.choice_view import ChoiceView
from serving.frontend.http.routes.choices import Choice, abort_choices
from serving.frontend.http.routes.logprob_shapes import TokenText
from serving.frontend.http.routes.openai_shapes import ResponseShape, usage
from serving.frontend.http.sse import SSE_DONE, SSEResponse, sse
from serving.frontend.http.state import ServerState
from serving.frontend.tokenizer_manager.req_state import Collected, ReqState
from telemetry.request_telemetry import server_timing


class Answer:
    """One request's choices, their views and how it ends (one HTTP span, or one per choice under it)."""

    def __init__(self, state: ServerState, req: ReqState, choices: list[Choice], shape: ResponseShape) -> None:
        self.state, self.req, self.choices, self.shape = state, req, choices, shape
        tokenizer = state.tm.prompts.tokenizer
        self.views = [ChoiceView(shape, c, tokenizer) for c in choices]
        n = max(c.index for c in choices) // max(1, max(c.prompt_index for c in choices) + 1) + 1
        self.firsts = {v.choice.prompt_index: v for v in self.views if v.choice.index % n == 0}

    @property
    def single(self) -> bool:
        return len(self.choices) == 1 and self.choices[0].state is self.req

    def end(self, status: int) -> None:
        if self.single:
            self.state.tel.end(self.req, status)
        else:
            self.state.tel.end_choices(self.req, [c.state for c in self.choices], status)

    def abort(self, reason: str = AbortReason.CLIENT_DISCONNECT) -> None:
        abort_choices(self.state, self.choices, reason)

    def usage(self, completion: int | None = None) -> dict:
        """Prompt tokens once per prompt (its first choice prefilled it), completion tokens over every choice."""
        firsts = [v.choice.state for v in self.firsts.values()]
        done = completion if completion is not None else sum(v.completion_tokens for v in self.views)
        return usage(
            sum(s.prompt_tokens for s in firsts), done, sum(s.cached_tokens for s in firsts), self.reasoning_tokens()
        )

    @property
    def reasoning(self) -> bool:
        """A reasoning parser reads these answers (--reasoning-parser)."""
        return any(v.parsing is not None and v.parsing.spec.reasoning for v in self.views)

    def reasoning_tokens(self) -> int | None:
        return sum(v.parsing.reasoning_tokens for v in self.views if v.parsing) if self.reasoning else None

    def breakdown(self) -> dict | None:
        if self.single:
            return self.req.breakdown
        first = self.choices[0].state.breakdown
        return {**(first or {}), "choices": [c.state.breakdown for c in self.choices]}


def make_shape(
    state: ServerState, req: ReqState, chat: bool, logprobs: bool, with_usage: bool, continuous: bool
) -> ResponseShape:
    tokens = TokenText(state.tm.prompts.tokenizer) if logprobs else None
    return ResponseShape(chat, req.rid, state.model_name, with_usage, continuous, tokens)


def stream(answer: Answer, events: AsyncIterator[bytes], headers: dict, timeout: float | None) -> SSEResponse:
    """`events` as an SSE response that aborts the answer's choices and ends its telemetry however it ends."""

    def on_close() -> None:
        answer.abort()
        answer.end(answer.req.status)

    return SSEResponse(events, on_close, headers, timeout)


async def collect(request: Request, answer: Answer, headers: dict) -> dict | Response:
    """The whole body (with its `sightline` breakdown and the Server-Timing header), the request ended with
    200; or the response it ended with instead (499 client gone, an error)."""
    state = answer.state
    results = await await_or_abort(
        request, asyncio.gather(*(state.tm.collect(c.state) for c in answer.choices)), answer.abort
    )
    if results is None:
        answer.end(CLIENT_GONE)
        return Response(status_code=CLIENT_GONE)
    for c, result in zip(answer.choices, results):
        if (err := result_error(result.finish_reason, result.error, c.state.status)) is not None:
            answer.abort(AbortReason.INTERNAL_ERROR)
            answer.end(err.status)
            return error_response(err, headers)
    body = _body(answer, results)
    body["sightline"] = answer.breakdown()
    if answer.single and answer.req.breakdown:
        headers["server-timing"] = server_timing(answer.req.breakdown)
    answer.end(200)
    return body


async def respond(request: Request, answer: Answer, headers: dict, streamed: bool, timeout: float | None) -> Response:
    if streamed:
        return stream(answer, _events(answer), headers, timeout)
    body = await collect(request, answer, headers)
    return body if isinstance(body, Response) else JSONResponse(body, headers=headers)


def _body(answer: Answer, results: list[Collected]) -> dict:
    shape, out = answer.shape, []
    prompt_field = None
    for v, r in zip(answer.views, results):
        first = answer.firsts[v.choice.prompt_index]
        prompt_lp = results[answer.views.index(first)].prompt_logprobs
        text, lp = v.piece(r.text, r.output_ids, r.logprobs, prompt_lp)
        finish = "length" if v.prompt_only else r.finish_reason
        plp = None
        if v.choice.obj.prompt_logprobs_field:
            plp = shape.prompt_logprobs(first.choice.state.prompt_ids or [], prompt_lp)
            prompt_field = prompt_field or plp
        if v.parsing is not None and v.parsing.result is not None:  # read for reasoning and tool calls
            out.append(
                shape.message(v.choice.index, v.parsing.result, v.choice.state.finish_reason, lp, answer.reasoning)
            )
            continue
        out.append(shape.choice(v.choice.index, text, finish, lp, plp))
    completion = (
        None
        if any(v.prompt_only or v.choice.obj.echo for v in answer.views)
        else sum(r.completion_tokens for r in results)
    )
    return shape.body(out, answer.usage(completion), prompt_field if shape.chat else None)


async def _outputs(answer: Answer) -> AsyncIterator[tuple[ChoiceView, StrOut]]:
    """Every choice's outputs as they arrive (one reader per choice when there are several)."""
    tm = answer.state.tm
    if len(answer.views) == 1:
        view = answer.views[0]
        async for out in tm.stream(view.choice.state):
            yield view, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(view: ChoiceView) -> None:
        try:
            async for out in tm.stream(view.choice.state):
                queue.put_nowait((view, out))
        finally:
            queue.put_nowait((view, None))

    tasks = [asyncio.ensure_future(pump(v)) for v in answer.views]
    try:
        left = len(tasks)
        while left:
            view, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield view, out
    finally:
        for t in tasks:
            t.cancel()


async def chunks(answer: Answer) -> AsyncIterator[dict]:
    """The stream's chunks as objects, in order; a choice's error ends it with that error's body."""
    shape, req = answer.shape, answer.req
    if shape.chat:
        running = answer.usage(0) if shape.continuous else None
        for v in answer.views:
            yield shape.role_chunk(running, v.choice.index)
    async for view, out in _outputs(answer):
        if (err := result_error(out.finish_reason, out.error, view.choice.state.status)) is not None:
            answer.abort(AbortReason.INTERNAL_ERROR)
            yield err.body()
            return
        if out.prompt_logprobs is not None:
            view.prompt_logprobs = out.prompt_logprobs
        text, lp, finish = view.out(out, answer.firsts[view.choice.prompt_index].prompt_logprobs)
        delta = view.delta()
        if (delta if delta is not None else text) or lp or finish is not None:
            running = None
            if shape.continuous:
                running = (
                    answer.usage()
                    if not answer.single
                    else usage(req.prompt_tokens, out.completion_tokens, req.cached_tokens, answer.reasoning_tokens())
                )
            yield shape.delta_chunk(text, finish, running, view.choice.index, lp, delta)
    if shape.with_usage:
        use = (
            answer.usage()
            if not answer.single or answer.views[0].prompt_only or answer.views[0].choice.obj.echo
            else usage(req.prompt_tokens, req.completion_tokens, req.cached_tokens, answer.reasoning_tokens())
        )
        chunk = shape.usage_chunk(use)
        chunk["sightline"] = answer.breakdown()
        yield chunk


async def _events(answer: Answer) -> AsyncIterator[bytes]:
    async for chunk in chunks(answer):
        yield sse(chunk)
    yield SSE_DONE
