"""The grammars that force tool calls, and the checks a constraint passes before the engine.

Without an engine, a forced call is simulated the way the engine will run it: llguidance's token
masks over the real tokenizer, a random allowed token at each step, until EOS.  Whatever the walk
writes must be read by the same format's parser as calls of the allowed tools, with arguments
valid for each tool's schema."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher

from protocol.sampling_params import MAX_GRAMMAR_BYTES, StructuredOutput
from serving.frontend.errors import APIError
from serving.frontend.output_parsing import ParsingConfig, ParsingSpec
from serving.frontend.tokenizer_manager.grammar_check import Constraint, GrammarChecker
from serving.frontend.tool_parsers import PARSERS, ToolSpec, get
from serving.structured import GrammarError, backend_tokenizer, check
from serving.structured.backend import limits
from tests.unit.serving.frontend.front import tokenizer

TOOLS = [
    ToolSpec(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    ),
    ToolSpec("now", {"type": "object", "properties": {}, "additionalProperties": False}),
]
_LL = None


def ll():
    global _LL
    if _LL is None:
        _LL = backend_tokenizer(tokenizer())
    return _LL


def walk(grammar: str, seed: int, steps: int = 160) -> str | None:
    """A random answer the grammar allows (None if it did not end within `steps` tokens)."""
    m, rng, out = LLMatcher(ll(), grammar, limits=limits(), log_level=0), random.Random(seed), []
    for _ in range(steps):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[: ll().vocab_size]
        token = int(rng.choice(np.nonzero(bits)[0]))
        if token == ll().eos_token:
            return tokenizer().decode(out)
        assert m.consume_token(token), m.get_error()
        out.append(token)
    return None


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_is_what_the_parser_reads(parser, parallel):
    grammar = get(parser).grammar(TOOLS, parallel, json.dumps)
    schemas = {t.name: t.parameters for t in TOOLS}
    ended = 0
    for seed in range(6):
        text = walk(grammar, seed)
        if text is None:
            continue
        ended += 1
        p = ParsingSpec(tools=get(parser)).start(lambda *a: pytest.fail(f"did not parse: {a}"))
        p.feed(text, 1)
        assert p.finish("stop") == "tool_calls", text
        calls = p.result.tool_calls
        assert calls and (parallel or len(calls) == 1), text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    assert ended >= 3


def test_a_named_choice_and_a_reasoning_prefix():
    grammar = get("hermes").grammar(TOOLS[:1], False, json.dumps, prefix="/\\n{0,2}/")
    for seed in range(4):
        text = walk(grammar, seed)
        assert text is None or '"name": "get_weather"' in text and text.lstrip("\n").startswith("<tool_call>")


def test_a_special_token_marker_is_forced_by_id():
    cfg = ParsingConfig(tool_parser="mistral", specials={"[TOOL_CALLS]": 7}, eos_text="</s>")
    assert cfg.marker("[TOOL_CALLS]") == "<[7]>" and cfg.marker("<tool_call>") == '"<tool_call>"'
    assert cfg.keeps_specials() and not ParsingConfig(tool_parser="mistral").keeps_specials()


def test_the_backend_check_computes_the_first_mask_with_a_tokenizer():
    exploding = StructuredOutput(kind="regex", spec="(.{1,100}){1,100}z")
    check(exploding)  # llguidance builds its lexer lazily: validation alone lets it pass
    with pytest.raises(GrammarError, match="too many expressions"):
        check(exploding, ll())
    check(StructuredOutput(kind="regex", spec="[a-z]{1,8}"), ll())


def _refused(constraint: Constraint) -> APIError:
    with pytest.raises(APIError) as exc:
        asyncio.run(GrammarChecker(tokenizer()).check([constraint]))
    assert exc.value.status == 400 and exc.value.param == constraint.param
    return exc.value


def test_the_checker_names_the_field_and_the_kind_of_error():
    schema = Constraint(StructuredOutput(kind="json_schema", spec='{"type": "strnig"}'), "response_format.x")
    assert _refused(schema).code == "invalid_schema"  # by the meta-schema: llguidance would not notice
    regex = Constraint(StructuredOutput(kind="regex", spec="(.{1,100}){1,100}z"), "structured_outputs.regex")
    assert _refused(regex).code == "invalid_grammar"
    big = json.dumps({"type": "object", "description": "x" * MAX_GRAMMAR_BYTES})
    assert "bytes" in _refused(Constraint(StructuredOutput(kind="json_schema", spec=big), "s")).message
    choice = Constraint(StructuredOutput(kind="choice", spec="[]"), "structured_outputs.choice")
    assert _refused(choice).code == "invalid_grammar"


def test_the_checker_builds_its_tokenizer_once_and_remembers_what_passed(monkeypatch):
    checker = GrammarChecker(tokenizer())
    ok = Constraint(StructuredOutput(kind="json_schema", spec='{"type": "object"}'), "response_format")
    built = []
    monkeypatch.setattr(checker, "_build", lambda: built.append(1) or ll())

    async def twice() -> None:
        await asyncio.gather(checker.check([ok]), checker.check([ok]))
        await checker.check([ok])

    asyncio.run(twice())
    assert built == [1] and len(checker._passed) == 1
