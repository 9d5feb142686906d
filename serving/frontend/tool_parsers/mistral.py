"""Mistral calls: `[TOOL_CALLS]` and a JSON list of call objects (the pre-v11 tokenizers' format).

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

The text before the marker is the message's content.  Mistral's chat templates want 9-character
alphanumeric call ids, so this format makes those instead of `call_…`.
"""

from __future__ import annotations

import random
import string

from serving.frontend.tool_parsers.base import Marker, Scan, ToolParser, guarded, held_back, literal, read_calls
from serving.frontend.tool_parsers.json_scan import skip_ws

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
            return read_calls(text, pos + listed, out, self.args_keys, final, "," if listed else None, MARK)

        return guarded(calls, text, final, out)

    def new_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def layout(self, parallel: bool, marker: Marker) -> tuple[str, list[str]]:
        calls = f"one ({literal(', ')} one)*" if parallel else "one"
        return f"{marker(MARK)} {literal('[')} {calls} {literal(']')}", []
