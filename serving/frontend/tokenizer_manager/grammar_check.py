"""Structured-output constraints checked before a request reaches the engine.

A schema or grammar that cannot be compiled is the client's mistake: it is answered with a 400
naming the field it came from (`response_format.json_schema.schema`, `tools[0].function.parameters`)
and never costs the engine a step.  Each constraint is checked by the grammar backend
(`serving.structured.check`) with an llguidance tokenizer built once from this front end's
tokenizer, so the lexer is built and the first mask computed too: a regex whose automaton explodes
fails here, within llguidance's limits.  JSON schemas are also checked against their JSON Schema
meta-schema (`jsonschema`): llguidance ignores keywords it does not know, a misspelt `"type"`
included.  The work runs in a thread (the tokenizer's build takes about a second once; a large
schema some milliseconds); specs that passed are remembered by digest, so `n` choices or a client
repeating its schema pay once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from protocol.sampling_params import MAX_GRAMMAR_BYTES, StructuredOutput
from serving.frontend.errors import bad_request
from serving.structured import GrammarError, backend_tokenizer, check

log = logging.getLogger(__name__)
REMEMBERED = 512  # digests of specs that passed


@dataclass(frozen=True)
class Constraint:
    """A spec to check, and the request field a 400 names."""

    so: StructuredOutput
    param: str

    @property
    def code(self) -> str:
        return "invalid_schema" if self.so.kind == "json_schema" else "invalid_grammar"


def meta_schema_error(schema: Any) -> str | None:
    """Why `schema` is not a JSON Schema by its meta-schema (its `$schema`'s draft, else 2020-12), or None."""
    if isinstance(schema, bool):
        return None
    from jsonschema import Draft202012Validator, SchemaError, validators

    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{exc.message}" + (f" (at {where})" if where else "")
    except RecursionError:
        return "it is nested too deeply"
    return None


class GrammarChecker:
    def __init__(self, tokenizer: Any) -> None:
        self.hf_tokenizer = tokenizer
        self._tokenizer: asyncio.Future | None = None
        self._passed: OrderedDict[bytes, None] = OrderedDict()

    async def _backend_tokenizer(self) -> Any:
        """llguidance's tokenizer, built on first use; None if this tokenizer cannot be wrapped (the specs
        are then validated without one)."""
        if self._tokenizer is None:
            self._tokenizer = asyncio.ensure_future(asyncio.to_thread(self._build))
        return await asyncio.shield(self._tokenizer)

    def _build(self) -> Any:
        try:
            return backend_tokenizer(self.hf_tokenizer)
        except Exception as exc:  # noqa: BLE001 - a slow tokenizer, say: the check goes on without the lexer
            log.warning(
                "structured outputs are checked without the tokenizer (%s): an exploding regex is only "
                "caught by the engine",
                exc,
            )
            return None

    async def check(self, constraints: list[Constraint]) -> None:
        """Raise a 400 naming the field of the first constraint that does not compile."""
        for c in constraints:
            size = len(c.so.spec.encode())
            if size > MAX_GRAMMAR_BYTES:
                raise bad_request(
                    f"{c.param} is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}", param=c.param, code=c.code
                )
            key = hashlib.sha256(json.dumps([c.so.kind, c.so.spec]).encode()).digest()
            if key in self._passed:
                self._passed.move_to_end(key)
                continue
            tokenizer = await self._backend_tokenizer()
            await asyncio.to_thread(self._check_one, c, tokenizer)
            self._passed[key] = None
            while len(self._passed) > REMEMBERED:
                self._passed.popitem(last=False)

    @staticmethod
    def _check_one(c: Constraint, tokenizer: Any) -> None:
        if c.so.kind == "json_schema" and (why := meta_schema_error(json.loads(c.so.spec))) is not None:
            raise bad_request(f"{c.param} is not a valid JSON Schema: {why}", param=c.param, code=c.code)
        try:
            check(c.so, tokenizer)
        except GrammarError as exc:
            raise bad_request(f"{c.param} cannot be compiled: {exc}", param=c.param, code=c.code) from None
