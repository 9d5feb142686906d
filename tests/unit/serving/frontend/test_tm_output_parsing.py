"""The TokenizerManager and a chat answer read for tool calls: the finish reason counted is the one the
client is told (`tool_calls`, outcome stop), a call that does not parse is counted by parser and kept
for the flight recorder, and a constraint that cannot compile never reaches the Scheduler."""

from __future__ import annotations

import asyncio
import functools

import pytest

from protocol.sampling_params import SamplingParams, StructuredOutput
from serving.frontend.errors import APIError
from serving.frontend.output_parsing import ParsingSpec
from serving.frontend.tokenizer_manager.grammar_check import Constraint
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState
from serving.frontend.tool_parsers import get
from telemetry.clock import now_ns
from tests.unit.serving.frontend.front import ready_front

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


async def _chat(f, constraints=()):
    state = ReqState(route="/v1/chat/completions", operation="chat", arrival=now_ns())
    state.parsing = ParsingSpec(tools=get("hermes")).start(functools.partial(f.tm.tel.tool_call_parse_failed, state))
    obj = GenerateReqInput(
        sampling=SamplingParams(temperature=0.0), prompt="hi", max_new_tokens=8, constraints=list(constraints)
    )
    return await f.tm.submit(obj, state)


def requests(f, reason: str) -> float | None:
    return f.sample(
        "sightline_requests_total", model_name="tiny-random", finish_reason=reason, status="200", outcome="stop"
    )


def test_a_stop_that_called_tools_is_counted_as_tool_calls_with_outcome_stop():
    async def body():
        f = ready_front()
        assert requests(f, "tool_calls") == 0  # exists from the start
        state = await _chat(f)
        f.output(state, CALL[:20], [1])
        f.output(state, CALL[20:], [2], finish_reason="stop")
        assert state.finish_reason == "tool_calls" and state.parsing.result.tool_calls
        assert requests(f, "tool_calls") == 1 and requests(f, "stop") == 0

        broken = await _chat(f)
        f.output(broken, '<tool_call>{"name": ', [1], finish_reason="stop")
        assert broken.finish_reason == "stop" and broken.parsing.result.content == '<tool_call>{"name": '
        assert f.sample("sightline_tool_call_parse_failures_total", parser="hermes") == 1
        assert f.sample("sightline_tool_call_parse_failures_total", parser="mistral") == 0
        assert broken.tool_call_failure == ("hermes", '<tool_call>{"name": ')

    asyncio.run(body())


def test_a_constraint_that_cannot_compile_is_refused_before_anything_is_sent():
    async def body():
        f = ready_front()
        bad = Constraint(StructuredOutput(kind="regex", spec="(.{1,100}){1,100}z"), "structured_outputs.regex")
        with pytest.raises(APIError) as exc:
            await _chat(f, [bad])
        assert (exc.value.param, exc.value.code) == ("structured_outputs.regex", "invalid_grammar")
        assert f.transport.sent == [] and f.tm.rid_to_state == {}
        ok = Constraint(StructuredOutput(kind="regex", spec="[ab]+"), "structured_outputs.regex")
        await _chat(f, [ok])
        assert len(f.transport.sent) == 1

    asyncio.run(body())
