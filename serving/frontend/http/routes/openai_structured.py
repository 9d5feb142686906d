"""A request's structured-output fields → the one `StructuredOutput` the engine enforces.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`) are read here, at most one constraint per
request (a second is a 400 naming it); vLLM's retired `guided_*` fields are refused with a message
naming their `structured_outputs` replacement.  Whether the spec compiles is checked later, before
the engine (serving.frontend.tokenizer_manager.grammar_check), under the field's name kept here.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.sampling_params import StructuredOutput
from serving.frontend.errors import bad_request
from serving.frontend.http.routes.openai_requests import _SamplingFields
from serving.frontend.tokenizer_manager.grammar_check import Constraint
from serving.structured.backend import closed_schema

GUIDED = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "structured_outputs (whose backend is llguidance, not chosen per request)",
}
_REFUSED = ("disable_fallback", "structural_tag")
# Whitespace between JSON tokens unless the request or the schema says otherwise: up to this many characters
# in a row. llguidance's default (any amount) lets a sampled model write newlines until max_tokens (3 of 200
# SmolLM2 samples at temperature 1); a bound still admits pretty-printed JSON nested 30 deep.
BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"
_WHITESPACE_KEYS = ("whitespace_flexible", "whitespace_pattern")


def refuse_guided(req: _SamplingFields) -> None:
    for name, instead in GUIDED.items():
        if getattr(req, name) is not None:
            raise bad_request(
                f"{name} was retired by vLLM and is not supported: use {instead}",
                param=name,
                code="unsupported_parameter",
            )


def json_spec(value: Any, param: str, options: dict[str, Any] | None = None, close: bool = True) -> str:
    """A JSON Schema given as an object or as JSON text → its JSON text (objects `closed`, with llguidance's
    options)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param=param, code="invalid_schema") from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON Schema (an object)", param=param, code="invalid_schema")
    if close:
        value = closed_schema(value)
    if isinstance(value, dict):
        own = value.get("x-guidance") if isinstance(value.get("x-guidance"), dict) else {}
        if not any(k in own or k in (options or {}) for k in _WHITESPACE_KEYS):
            options = {**(options or {}), "whitespace_pattern": BOUNDED_WHITESPACE}
        value = {**value, "x-guidance": {**own, **(options or {})}}
    try:
        return json.dumps(value)
    except RecursionError:
        raise bad_request(f"{param} is nested too deeply", param=param, code="invalid_schema") from None


JSON_OBJECT = json_spec({"type": "object"}, "response_format")  # any object


def _response_format(req: _SamplingFields) -> list[Constraint]:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [Constraint(StructuredOutput(kind="json_schema", spec=JSON_OBJECT), "response_format")]
    if fmt.type != "json_schema":
        raise bad_request(
            f"response_format type {fmt.type!r} is not supported (text, json_object, json_schema)",
            param="response_format.type",
            code="unsupported_parameter",
        )
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request(
            "response_format.json_schema.schema is required with type json_schema",
            param="response_format.json_schema.schema",
            code="invalid_schema",
        )
    param = "response_format.json_schema.schema"
    return [Constraint(StructuredOutput(kind="json_schema", spec=json_spec(fmt.json_schema.schema, param)), param)]


def _structured_outputs(req: _SamplingFields) -> list[Constraint]:
    so = req.structured_outputs
    if so is None:
        return []
    for name in _REFUSED:
        if getattr(so, name) is not None:
            raise bad_request(
                f"structured_outputs.{name} is not supported by this server",
                param=f"structured_outputs.{name}",
                code="unsupported_parameter",
            )
    options: dict[str, Any] = {}
    if so.disable_any_whitespace:
        options["whitespace_flexible"] = False
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    found = []
    if so.json is not None:
        spec = json_spec(so.json, "structured_outputs.json", options, so.disable_additional_properties is not False)
        found.append(Constraint(StructuredOutput(kind="json_schema", spec=spec), "structured_outputs.json"))
    if so.json_object:
        spec = json_spec({"type": "object"}, "structured_outputs.json_object", options)
        found.append(Constraint(StructuredOutput(kind="json_schema", spec=spec), "structured_outputs.json_object"))
    for kind, value in (("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
        if value is not None:
            spec = json.dumps(value) if kind == "choice" else value
            found.append(Constraint(StructuredOutput(kind=kind, spec=spec), f"structured_outputs.{kind}"))
    if options and not any(c.so.kind == "json_schema" for c in found):
        name = "disable_any_whitespace" if so.disable_any_whitespace else "whitespace_pattern"
        raise bad_request(
            f"structured_outputs.{name} applies to json and json_object only", param=f"structured_outputs.{name}"
        )
    if not found and not options and so.disable_any_whitespace is None:
        raise bad_request(
            "structured_outputs needs one of json, regex, choice, grammar, json_object", param="structured_outputs"
        )
    return found


def _narrows_an_object(found: list[Constraint]) -> bool:
    """response_format json_object with structured_outputs.json an object schema: the schema says which object
    (the way instructor's JSON mode is used against vLLM, the schema passed in extra_body), not a conflict."""
    if len(found) != 2 or found[0].param != "response_format" or found[1].param != "structured_outputs.json":
        return False
    if found[0].so.spec != JSON_OBJECT:
        return False
    schema = json.loads(found[1].so.spec)
    return isinstance(schema, dict) and (schema.get("type") == "object" or "properties" in schema)


def structured_output(req: _SamplingFields) -> list[Constraint]:
    """The request's constraint (a one-element list), or none; a 400 naming the second of two (except an object
    schema beside json_object, which narrows it)."""
    refuse_guided(req)
    found = _response_format(req) + _structured_outputs(req)
    if _narrows_an_object(found):
        return found[1:]
    if len(found) > 1:
        raise bad_request(
            f"at most one structured output constraint per request: got {found[0].param} and {found[1].param}",
            param=found[1].param,
            code="conflicting_constraints",
        )
    return found


def with_start(c: Constraint, after: tuple[int, ...]) -> Constraint:
    """The constraint starting after `after` (a reasoning model's end of thinking) when given."""
    if not after:
        return c
    so = StructuredOutput(kind=c.so.kind, spec=c.so.spec, after_token_ids=after)
    return Constraint(so, c.param)
