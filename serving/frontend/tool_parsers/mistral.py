"""Mistral calls: `[TOOL_CALLS]` and a JSON list of call objects (the pre-v11 tokenizers' format).

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

The text before the marker is the message's content.  Mistral's chat templates want 9-character
alphanumeric call ids, so this format makes those instead of `call_…`.
"""

from __future__ import annotations

import random
import string

from serving.frontend.tool_parsers.base import Marker, Scan, ToolParser, guarded, held_back, literal, read_call
from serving.frontend.tool_parsers.json_scan import ScanError, skip_ws

MARK = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"

    def scan(self, text: str, final: bool) -> Scan:
        i = text.find(MARK)
        if i < 0:
            return Scan(text if final else held_back(text, MARK))
        out = Scan(text[:i].rstrip(), started=True)

        def calls() -> Scan:
            pos = skip_ws(text, i + len(MARK))
            listed = text.startswith("[", pos)
            pos += listed
            while True:
                pos = skip_ws(text, pos)
                if pos >= len(text):
                    if final and not out.calls:
                        raise ScanError("no call after [TOOL_CALLS]")
                    return out
                if text[pos] != "{":
                    raise ScanError("expected a call object")
                call, end = read_call(text, pos, self.args_keys, final)
                out.calls.append(call)
                if end is None:
                    return out
                pos = skip_ws(text, end)
                if not (listed and text.startswith(",", pos)):
                    return out
                pos += 1

        return guarded(calls, text, final, out)

    def new_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def layout(self, parallel: bool, marker: Marker) -> tuple[str, list[str]]:
        calls = f"one ({literal(', ')} one)*" if parallel else "one"
        return f"{marker(MARK)} {literal('[')} {calls} {literal(']')}", []
