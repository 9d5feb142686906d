"""The grammar backend: specs checked by llguidance, objects closed as strict clients expect."""

from __future__ import annotations

import json

import jsonschema
import pytest
from llguidance import LLMatcher

from protocol.sampling_params import StructuredOutput
from serving.structured.backend import GrammarError, check, closed_schema


def so(kind: str, spec) -> StructuredOutput:
    return StructuredOutput(kind=kind, spec=spec if isinstance(spec, str) else json.dumps(spec))


def test_objects_with_properties_are_closed_everywhere():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "array", "items": {"properties": {"x": {}}}},
            "d": {"anyOf": [{"properties": {"y": {}}}, {"type": "null"}]},
        },
        "$defs": {"D": {"properties": {"z": {}}}},
    }
    out = closed_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not modified
    jsonschema.validate({"a": {"b": 1}}, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"b": 1}, "invented": 2}, out)


def test_what_a_schema_says_of_other_keys_is_kept():
    assert closed_schema({"type": "object"}) == {"type": "object"}  # json_object: any object
    opened = {"properties": {"a": {}}, "additionalProperties": True}
    assert closed_schema(opened) == opened
    patterned = {"properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert closed_schema(patterned) == patterned
    # allOf's members each list part of the keys: closing them would admit no object at all
    parts = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_schema(parts) == parts
    jsonschema.validate({"a": 1, "b": 2}, closed_schema(parts))
    beside = {"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]}
    assert closed_schema(beside) == beside


def test_deep_schemas_are_closed_to_a_bound_not_to_the_recursion_limit():
    schema: dict = {"type": "object", "properties": {}}
    inner = schema
    for _ in range(3000):
        inner["properties"]["x"] = {"type": "object", "properties": {}}
        inner = inner["properties"]["x"]
    out = closed_schema(schema)
    assert out["additionalProperties"] is False


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}),
        ("json_schema", True),
        ("regex", r"[a-z]{2,5}\d"),
        ("choice", ["yes", "no"]),
        ("grammar", 'start: "a" "b"+'),
        ("grammar", 'root ::= "yes" | "no"'),  # GBNF
    ],
)
def test_valid_specs_give_a_grammar_llguidance_accepts(kind, spec):
    grammar = check(so(kind, spec))
    assert LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize(
    "kind,spec,says",
    [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", [1, 2], "must be an object"),
        ("json_schema", {"type": "objectx"}, "objectx"),
        ("regex", "(a", "unclosed group"),
        ("choice", [], "non-empty list"),
        ("choice", ["a", 1], "non-empty list"),
        ("grammar", 'start: "a" | b', "unknown name"),
        ("nonsense", "x", "unknown structured output kind"),
    ],
)
def test_invalid_specs_name_the_problem(kind, spec, says):
    with pytest.raises(GrammarError, match=says):
        check(so(kind, spec))
