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


def to_backend_grammar(so: StructuredOutput) -> str:
    """llguidance's grammar text for `so` (raises GrammarError when the spec is not even parseable)."""
    if so.kind == "json_schema":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {} if schema else {"not": {}})
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
