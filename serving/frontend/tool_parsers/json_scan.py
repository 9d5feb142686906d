"""JSON as a model writes it: where a value ends, or that it has not ended yet.

The tool-call parsers read a call while it streams, so they need more than `json.loads`:
the span of each top-level field of an object whose end may not have arrived.  Strings are
skipped with one regular expression (linear: its alternatives cannot both match), brackets
are counted, and whether the text between is valid JSON is left to `json.loads` once the
value is complete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_WS = re.compile(r"\s*")
_LITERALS = ("true", "false", "null")


class ScanError(ValueError):
    """The text cannot become JSON whatever follows it."""


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def value_end(text: str, i: int) -> int | None:
    """The index just after the JSON value starting at `text[i]`, or None when the text ends inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        return m.end() if m else None
    if c in "{[":
        return _container_end(text, i)
    m = _SCALAR.match(text, i)
    if m is not None and m.end() < len(text):
        return m.end()
    rest = text[i:]
    if m is not None or rest == "-" or any(lit.startswith(rest) for lit in _LITERALS):
        return None  # a number may go on, a literal is half written
    raise ScanError(f"not a JSON value at {i}")


def _container_end(text: str, i: int) -> int | None:
    depth, pos = 0, i
    while True:
        m = _STRUCTURE.search(text, pos)
        if m is None:
            return None
        if m.group() == '"':
            s = _STRING.match(text, m.start())
            if s is None:
                return None
            pos = s.end()
            continue
        depth += 1 if m.group() in "{[" else -1
        pos = m.end()
        if depth == 0:
            return pos


@dataclass
class ObjectScan:
    """The top-level fields of an object seen so far: key → (value start, value end or None)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # just after the closing brace, once it arrived


def scan_object(text: str, i: int) -> ObjectScan:
    """The object starting at `text[i]` (a `{`), as far as the text goes; raises ScanError on non-JSON."""
    out = ObjectScan()
    pos = skip_ws(text, i + 1)
    if pos < len(text) and text[pos] == "}":
        out.end = pos + 1
        return out
    while pos < len(text):
        if text[pos] != '"':
            raise ScanError(f"expected a key at {pos}")
        key_end = value_end(text, pos)
        if key_end is None:
            return out
        key = _STRING.match(text, pos).group()[1:-1]
        pos = skip_ws(text, key_end)
        if pos >= len(text):
            return out
        if text[pos] != ":":
            raise ScanError(f"expected ':' at {pos}")
        start = skip_ws(text, pos + 1)
        if start >= len(text):
            return out
        end = value_end(text, start)
        out.fields[key] = (start, end)
        if end is None:
            return out
        pos = skip_ws(text, end)
        if pos >= len(text):
            return out
        if text[pos] == "}":
            out.end = pos + 1
            return out
        if text[pos] != ",":
            raise ScanError(f"expected ',' or '}}' at {pos}")
        pos = skip_ws(text, pos + 1)
    return out
