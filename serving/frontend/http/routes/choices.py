"""A request with several choices (`n` > 1, or a list of prompts on /v1/completions): one sub-request
per choice, submitted to the TokenizerManager like any other, answered as one response.

Choice `i * n + j` is choice j of prompt i (OpenAI's numbering).  The first choice of each prompt is
submitted first; its siblings once it has produced its first token, so that its prompt is in the
prefix cache by then and they prefill one token each instead of the whole prompt (one prefill, n
decodes).  Only that first choice computes the prompt's logprobs (echo, `prompt_logprobs`); its
siblings show the same.  A seeded request gives choice j the seed `seed + j`, so its choices differ
and the whole response still reproduces.

Each choice has its own `ReqState` (own rid, metrics, a `choice` span under the HTTP span); a
submission refused part-way aborts those already sent and answers the refusal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass

import msgspec

from protocol.reasons import AbortReason
from serving.frontend.http.state import ServerState
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState

SEED_SPAN = 2**63


@dataclass
class Choice:
    index: int  # OpenAI's choice index
    prompt_index: int
    obj: GenerateReqInput
    state: ReqState


def expand(obj: GenerateReqInput) -> list[tuple[int, int, GenerateReqInput]]:
    """(index, prompt index, sub-request) per choice; the request itself when it has one choice."""
    prompts = obj.batch if obj.batch is not None else [obj.prompt]
    if len(prompts) == 1 and obj.n == 1:
        return [(0, 0, dataclasses.replace(obj, prompt=prompts[0], batch=None))]
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(obj.n):
            sp = obj.sampling
            seed = None if sp.seed is None else (sp.seed + j) % SEED_SPAN
            sampling = msgspec.structs.replace(
                sp,
                seed=seed,
                prompt_logprobs=sp.prompt_logprobs if j == 0 else None,
                stop_token_ids=list(sp.stop_token_ids),
                logit_bias=dict(sp.logit_bias),
            )
            out.append(
                (
                    i * obj.n + j,
                    i,
                    dataclasses.replace(
                        obj, prompt=prompt, batch=None, n=1, sampling=sampling, stop=list(obj.stop), rid=None
                    ),
                )
            )
    return out


async def _started(state: ReqState) -> None:
    """Until the request's first output arrived (its prompt is prefilled) or it ended."""
    while not (state.started or state.finished):
        await state.event.wait()
        if not (state.started or state.finished):
            state.event.clear()


def _read_answers(state: ServerState, choice: ReqState, obj: GenerateReqInput) -> None:
    """A chat choice whose answer is read for reasoning or tool calls gets its own parsing."""
    if obj.parsing is not None:
        choice.parsing = obj.parsing.start(functools.partial(state.tel.tool_call_parse_failed, choice))


async def submit_choices(state: ServerState, parent: ReqState, obj: GenerateReqInput) -> list[Choice]:
    """Submit every choice (see the module's docstring); raises the first refusal, after aborting the rest."""
    subs = expand(obj)
    if len(subs) == 1:
        _, _, sub = subs[0]
        _read_answers(state, parent, sub)
        await state.tm.submit(sub, parent)
        return [Choice(0, 0, sub, parent)]
    choices = []
    for index, prompt_index, sub in subs:
        child = ReqState(
            route=parent.route,
            operation=parent.operation,
            arrival=parent.arrival,
            stream=parent.stream,
            tenant=parent.tenant,
        )
        state.tel.begin_choice(parent, child, index)
        _read_answers(state, child, sub)
        choices.append(Choice(index, prompt_index, sub, child))
    firsts = [c for c in choices if c.index % obj.n == 0]
    rest = [c for c in choices if c.index % obj.n != 0]
    sent: list[Choice] = []
    try:
        for c in firsts:
            await state.tm.submit(c.obj, c.state)
            sent.append(c)
        if rest:
            await asyncio.gather(*(_started(c.state) for c in firsts))
        for c in rest:
            await state.tm.submit(c.obj, c.state)
            sent.append(c)
    except BaseException:
        for c in sent:
            state.tm.abort(c.state.rid, AbortReason.CLIENT_DISCONNECT)
        state.tel.close_choices([c.state for c in choices])
        raise
    return choices


def abort_choices(state: ServerState, choices: list[Choice], reason: str) -> None:
    for c in choices:
        if not c.state.finished:
            state.tm.abort(c.state.rid, reason)
