"""Hermes-style calls (Qwen2, Qwen2.5, Qwen3, Hermes): a JSON object per `<tool_call>` block.

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text before the first block is the message's content; a missing `</tool_call>` at the end is
accepted, text between and after the blocks is dropped.
"""

from __future__ import annotations

from serving.frontend.tool_parsers.base import Marker, Scan, ToolParser, guarded, held_back, literal, read_call
from serving.frontend.tool_parsers.json_scan import ScanError, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        i = text.find(START)
        if i < 0:
            return Scan(text if final else held_back(text, START))
        out = Scan(text[:i].rstrip(), started=True)

        def calls() -> Scan:
            pos = i
            while pos >= 0:
                j = skip_ws(text, pos + len(START))
                if j >= len(text):
                    if final:
                        raise ScanError("a <tool_call> block without a call")
                    break
                if text[j] != "{":
                    raise ScanError("a <tool_call> block that is not a JSON object")
                call, end = read_call(text, j, self.args_keys, final)
                out.calls.append(call)
                if end is None:
                    break
                pos = text.find(START, end)
            return out

        return guarded(calls, text, final, out)

    def layout(self, parallel: bool, marker: Marker) -> tuple[str, list[str]]:
        block = f"block: {marker(START)} {literal(chr(10))} one {literal(chr(10) + END)}"
        return (f"block ({literal(chr(10))} block)*" if parallel else "block"), [block]
