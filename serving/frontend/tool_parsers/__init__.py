"""Tool-call parsers: each model family's format for calling a function, read from the answer's text
(after the fact, and while it streams), and the grammar that forces it (`tool_choice` required or
named).  `--tool-call-parser auto` picks the format from the chat template's text."""

from __future__ import annotations

from serving.frontend.tool_parsers.base import ToolParser, ToolSpec, valid_name
from serving.frontend.tool_parsers.hermes import HermesParser
from serving.frontend.tool_parsers.llama3_json import Llama3JsonParser
from serving.frontend.tool_parsers.mistral import MistralParser
from serving.frontend.tool_parsers.stream import ToolCallStream
from telemetry.metrics import TOOL_CALL_PARSERS

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
assert tuple(PARSERS) == TOOL_CALL_PARSERS, "telemetry.metrics.TOOL_CALL_PARSERS lists the parsers' metric labels"
CHOICES = ("auto", *PARSERS, "none")
# what in a chat template's text says which format the model was trained on, checked in this order
_SIGNS = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
    ("<tool_call>", "hermes"),
)


def detect(template: str | None) -> tuple[str, str]:
    """(parser, why) for `--tool-call-parser auto`: the first sign found in the template, else hermes."""
    for sign, name in _SIGNS:
        if template and sign in template:
            return name, f"the chat template mentions {sign}"
    return "hermes", "no known sign in the chat template: the default"


def get(name: str) -> ToolParser:
    return PARSERS[name]()


__all__ = ["CHOICES", "PARSERS", "ToolCallStream", "ToolParser", "ToolSpec", "detect", "get", "valid_name"]
