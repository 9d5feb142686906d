"""What every tool-call format shares: a call read while it streams, the scan of a whole output, and
the Lark rule that forces one call of a named tool.

A format (`ToolParser`) has one method that matters, `scan(text, final)`: the content and the calls
of the text generated so far.  The same scan serves the whole answer (`final=True`) and the stream
(`final=False`), so what a stream sent is always a prefix of the whole answer: content held back
while it may still turn into a call (a half-written marker, trailing whitespace), a call's name
only once its string is complete, its arguments as the raw text the model wrote (the streamed
pieces concatenate to the final `arguments`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from serving.frontend.tool_parsers.json_scan import ScanError, scan_object, skip_ws

NAME_KEYS = ("name",)


@dataclass
class CallProgress:
    """One call as far as it was written."""

    name: str | None  # once its string is complete
    arguments: str  # the arguments' JSON text so far: a prefix of the final text
    done: bool = False  # the call's object is complete and valid


@dataclass
class Scan:
    content: str  # text that is not a call and may be sent (all of it when final)
    calls: list[CallProgress] = field(default_factory=list)
    started: bool = False  # the text started a call (a marker, or a call's opening)
    failed: bool = False  # final: it started a call that does not parse (then `content` is the whole text)


@dataclass(frozen=True)
class ToolSpec:
    """A tool the request offers: its name and its parameters' JSON Schema (an object schema)."""

    name: str
    parameters: dict


Marker = Callable[[str], str]  # a literal of the output → its Lark form (a special token by id, else a string)


def literal(text: str) -> str:
    """A Lark string literal (JSON's escapes)."""
    return json.dumps(text)


def held_back(text: str, marker: str) -> str:
    """`text` less a trailing half-written `marker` and trailing whitespace: what may be streamed now."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            text = text[:-k]
            break
    return text.rstrip()


def read_call(text: str, i: int, args_keys: tuple[str, ...], final: bool) -> tuple[CallProgress, int | None]:
    """The call object at `text[i]` (a `{`) and the index after it (None while it is unfinished);
    raises ScanError when it cannot be a call (not JSON, no name, arguments not an object)."""
    obj = scan_object(text, i)
    name, args = None, ""
    if (span := next((obj.fields[k] for k in NAME_KEYS if k in obj.fields), None)) and span[1] is not None:
        name = json.loads(text[span[0] : span[1]])
        if not isinstance(name, str):
            raise ScanError("the call's name is not a string")
    key = next((k for k in args_keys if k in obj.fields), None)
    if key is not None:
        start, end = obj.fields[key]
        if text[start] == "{":  # streamed as written
            args = text[start : end if end is not None else len(text)]
        elif end is not None:  # a JSON string holding the object: known once complete
            args = json.loads(text[start:end])
            if not isinstance(args, str):
                raise ScanError("the call's arguments are not an object")
    if obj.end is None:
        if final:
            raise ScanError("the call is unfinished")
        return CallProgress(name, args), None
    if name is None:
        raise ScanError("the call has no name")
    args = args or "{}"
    try:
        if not isinstance(json.loads(args), dict):
            raise ScanError("the call's arguments are not an object")
    except ValueError:
        raise ScanError("the call's arguments are not JSON") from None
    return CallProgress(name, args, True), obj.end


def read_calls(
    text: str, pos: int, out: Scan, args_keys: tuple[str, ...], final: bool, separator: str | None, after: str
) -> Scan:
    """Call objects from `text[pos]` on, separated by `separator` (None: one only), appended to `out.calls`;
    raises ScanError when what follows `after` (the marker, for the message) is not a call."""
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            if final and not out.calls:
                raise ScanError(f"no call after {after}")
            return out
        if text[pos] != "{":
            raise ScanError("expected a call object")
        call, end = read_call(text, pos, args_keys, final)
        out.calls.append(call)
        if end is None:
            return out
        pos = skip_ws(text, end)
        if separator is None or not text.startswith(separator, pos):
            return out
        pos += len(separator)


class ToolParser:
    """One model family's tool-call format (subclasses: hermes, llama3_json, mistral)."""

    name = ""
    args_key = "arguments"  # the key the format writes (and the forced grammar produces)
    args_keys: tuple[str, ...] = ("arguments",)  # the keys accepted when parsing

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def layout(self, parallel: bool, marker: Marker) -> tuple[str, list[str]]:
        """The forced grammar's `start` expression over the rule `one` (one call), and its other rules."""
        raise NotImplementedError

    def call_rule(self, tool: ToolSpec, args_rule: str) -> str:
        """The Lark body of one call of `tool` whose arguments are `args_rule`, in this format."""
        head = "{" + f"{literal('name')}: {literal(tool.name)}, {literal(self.args_key)}: "
        return f"{literal(head)} {args_rule} {literal('}')}"

    def new_id(self) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def grammar(self, tools: list[ToolSpec], parallel: bool, marker: Marker, prefix: str = "") -> str:
        """Lark for exactly this format: one call (one or more with `parallel`) of one of `tools`, whose
        arguments match the tool's schema (compact JSON: no stray whitespace for a model to loop in);
        `prefix`: Lark placed before it (the whitespace a reasoning model writes after thinking)."""
        compact = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
        rules = []
        for i, tool in enumerate(tools):
            schema = {**tool.parameters, "x-guidance": compact}
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
            rules.append(f"call_{i}: {self.call_rule(tool, f'args_{i}')}")
        expr, extra = self.layout(parallel, marker)
        one = " | ".join(f"call_{i}" for i in range(len(tools)))
        return (
            "\n".join([f"start: {prefix} {expr}" if prefix else f"start: {expr}", *extra, f"one: {one}", *rules]) + "\n"
        )


def guarded(scan: Callable[[], Scan], text: str, final: bool, partial: Scan) -> Scan:
    """Run a format's scan: text that cannot be a call fails the final scan (the whole text is content)
    and stops a partial one where it was (`partial`: what was read before the error)."""
    try:
        return scan()
    except ValueError:  # ScanError, or json.loads on a complete but invalid value
        return Scan(text, started=True, failed=True) if final else partial


_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def valid_name(name: str) -> bool:
    """OpenAI's rule for a function name (letters, digits, `_`, `-`; vLLM also lets `.` and `:` pass)."""
    return bool(_NAME.match(name))
