"""The grammar backend (llguidance): a `StructuredOutput` as llguidance's grammar text, and its check.

llguidance (a Rust wheel, no torch) compiles JSON Schema, regex, Lark and GBNF lazily into a token-mask
matcher; its parser limits bound what a hostile spec can cost (`LIMITS`), so a regex that would explode
is an error at compile time, not a hung step.  Another backend (xgrammar) would be another module with
the same three names.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from protocol.sampling_params import StructuredOutput


class GrammarError(ValueError):
    """The spec cannot be compiled: the message says which part and why (the API's 400 invalid_schema)."""


def limits() -> LLParserLimits:
    """Parser limits for every grammar: llguidance's defaults, errors without the grammar's text (they reach
    clients and logs)."""
    return LLParserLimits(verbose_errors=False)


MAX_SCHEMA_DEPTH = 64  # deeper subschemas are left as written (llguidance bounds what they may cost)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "additionalItems",
    "propertyNames",
)


def closed_schema(schema: object, close: bool = True, depth: int = 0) -> object:
    """A copy of `schema` where every object that lists `properties` and says nothing of other keys
    (`additionalProperties`, `patternProperties`, `unevaluatedProperties`) allows no others.

    JSON Schema leaves such objects open, so a grammar built from the letter of the schema lets a small
    model append invented keys until max_tokens; OpenAI's strict mode and xgrammar's default (vLLM's,
    SGLang's) close them, and the clients that generate schemas from Pydantic models expect that.  A
    schema that wants other keys says `"additionalProperties": true`.  The direct members of an `allOf`
    stay as they are, and so does an object beside an `allOf` (each lists only its part of the keys: closing
    them would admit no object)."""
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s, key != "allOf", depth + 1) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v, True, depth + 1) for k, v in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key], True, depth + 1)
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def to_backend_grammar(so: StructuredOutput) -> str:
    """llguidance's grammar text for `so` (raises GrammarError when the spec is not even parseable)."""
    if so.kind == "json_schema":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return LLMatcher.grammar_from_json_schema(schema)
    if so.kind == "regex":
        return LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError as e:
            raise GrammarError(f"the choices are not a JSON list: {e}") from None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise GrammarError("choice must be a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if so.kind == "grammar":
        try:
            lark = any_to_lark(so.spec)
        except Exception as e:  # noqa: BLE001 - the converter raises whatever its parser raised
            raise GrammarError(f"the grammar is neither Lark nor GBNF: {e}") from None
        return LLMatcher.grammar_from_lark(lark)
    raise GrammarError(f"unknown structured output kind {so.kind!r}")


def backend_tokenizer(hf_tokenizer: Any) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer: about a second for a large vocabulary, so build
    it once and off the event loop."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer)


def _message(text: str) -> str:
    """llguidance's error without its `<non-verbose/>` placeholder line."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip() and line.strip() != "<non-verbose/>")


def check(so: StructuredOutput, tokenizer: LLTokenizer | None = None) -> str:
    """The backend grammar for `so` after llguidance validated it; raises GrammarError with llguidance's
    message.  With `tokenizer` the first token mask is computed too: llguidance builds its lexer lazily,
    so a regex whose automaton explodes (`(.{1,100}){1,100}z`) passes validation and fails there, within
    llguidance's limits, instead of on the engine's first step."""
    grammar = to_backend_grammar(so)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits())
    if is_error:
        raise GrammarError(_message(messages[0]) if messages else "the grammar is invalid")
    if tokenizer is not None:
        matcher = LLMatcher(tokenizer, grammar, limits=limits(), log_level=0)
        matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(_message(matcher.get_error()) or "the grammar is invalid")
    return grammar
