"""Llama 3.x JSON-based calls: the whole answer is the call, optionally after `<|python_tag|>`.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls are separated by `;`.  An answer that starts with `{` (or the tag) is read as calls,
so it is held back while it streams until it is known to be one; text after the last call is
dropped.  `arguments` is accepted in place of `parameters`.
"""

from __future__ import annotations

from serving.frontend.tool_parsers.base import Marker, Scan, ToolParser, guarded, literal, read_calls
from serving.frontend.tool_parsers.json_scan import skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    args_key = "parameters"
    args_keys = ("parameters", "arguments")

    def scan(self, text: str, final: bool) -> Scan:
        s = skip_ws(text, 0)
        if text.startswith(TAG, s):
            first = s + len(TAG)
        elif text.startswith("{", s):
            first = s
        elif not final and TAG.startswith(text[s:]):
            return Scan("")  # undecided: nothing but whitespace, or half the tag
        else:
            return Scan(text if final else text.rstrip())
        out = Scan("", started=True)

        def calls() -> Scan:
            return read_calls(text, first, out, self.args_keys, final, ";", "the tag")

        return guarded(calls, text, final, out)

    def layout(self, parallel: bool, marker: Marker) -> tuple[str, list[str]]:
        return (f"one ({literal('; ')} one)*" if parallel else "one"), []
