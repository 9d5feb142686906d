"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls` → what the template renders, how
the answer is read, and the grammar that forces a call.

- `tools`: functions only; each needs `function.name` (OpenAI's characters, unique) and, if given,
  `parameters` as an object schema (absent: no arguments), checked like any structured output
  (meta-schema, llguidance) whatever `tool_choice` says.  The tools go to the chat template as
  its `tools` variable, as transformers' apply_chat_template passes them.
- `tool_choice`: `auto` (the default with tools: free text, read by the server's tool-call parser),
  `none` (tools rendered, nothing read), `required` or `{"type": "function", "function": {"name"}}`:
  forced with a grammar of the parser's own format (serving.frontend.tool_parsers), so the model
  writes the calls it was trained to write and the same parser reads them; a named function is
  called once (as vLLM), `required` one or more times; the arguments' objects are closed where
  their schema leaves them open (`openai_structured.closed`).
- `parallel_tool_calls` (default true): false allows one call (the grammar, and the parser keeps the
  first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.sampling_params import StructuredOutput
from serving.frontend.errors import bad_request
from serving.frontend.output_parsing import ParsingConfig, ParsingSpec
from serving.frontend.tokenizer_manager.grammar_check import Constraint
from serving.frontend.tool_parsers import ToolSpec, get, valid_name
from serving.structured.backend import closed_schema

MAX_TOOLS = 128  # OpenAI's limit
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None  # always strict here: forced calls follow the schema, parsed ones are not checked


class ToolDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


@dataclass
class ToolSetup:
    template_tools: list[dict] | None = None  # the template's `tools`
    parsing: ParsingSpec | None = None  # how answers are read (tools part; the route adds reasoning)
    forced: Constraint | None = None  # tool_choice required or named: the grammar
    checks: list[Constraint] = field(default_factory=list)  # every tool's schema, by its field
    keep_specials: bool = False  # the format's marker is a special token the Detokenizer must keep


def _path(message: str) -> str:
    """The field msgspec's message is about, below the tool: `.function.name` for a missing name."""
    where = message.split(" - at `$", 1)
    path = where[1].rstrip("`") if len(where) == 2 else ""
    named = message.split("field `", 1)
    return path + ("." + named[1].split("`", 1)[0] if len(named) == 2 else "")


def _tool(i: int, raw: Any) -> tuple[dict, ToolSpec]:
    try:
        tool = msgspec.convert(raw, ToolDef)
    except msgspec.ValidationError as exc:
        raise bad_request(f"tools[{i}]: {exc}", param=f"tools[{i}]{_path(str(exc))}") from None
    if tool.type != "function":
        raise bad_request(f"tools[{i}].type must be 'function', got {tool.type!r}", param=f"tools[{i}].type")
    fn = tool.function
    if not valid_name(fn.name):
        raise bad_request(
            f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {fn.name!r}",
            param=f"tools[{i}].function.name",
        )
    param = f"tools[{i}].function.parameters"
    params = fn.parameters
    if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
        raise bad_request(
            f"{param} must be a JSON Schema of an object (the arguments), got {json.dumps(params)[:80]}",
            param=param,
            code="invalid_schema",
        )
    rendered = {"type": "function", "function": {k: v for k, v in msgspec.structs.asdict(fn).items() if v is not None}}
    return rendered, ToolSpec(fn.name, params if params is not None else NO_ARGUMENTS)


def template_tools(raw: list[Any] | None) -> tuple[list[dict] | None, list[ToolSpec]]:
    """The tools as the template renders them, and their specs (400 naming the field at fault)."""
    if raw is None:
        return None, []
    if not 1 <= len(raw) <= MAX_TOOLS:
        raise bad_request(f"tools must list 1 to {MAX_TOOLS} tools, got {len(raw)}", param="tools")
    pairs = [_tool(i, t) for i, t in enumerate(raw)]
    names = [spec.name for _, spec in pairs]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    return [r for r, _ in pairs], [s for _, s in pairs]


def _choice(choice: Any, specs: list[ToolSpec]) -> tuple[str, str | None]:
    """(`auto` | `none` | `required` | `function`, the named function's name)."""
    if choice is None:
        return ("auto" if specs else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice must be auto, none, required or a function, got {choice!r}", param="tool_choice"
            )
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request(
            'tool_choice must be auto, none, required or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {s.name for s in specs}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among tools", param="tool_choice")
    return "function", name


def tool_setup(
    tools: list[Any] | None, choice: Any, parallel: bool | None, cfg: ParsingConfig, after: tuple[int, ...]
) -> ToolSetup:
    """What the request's tool fields mean on this server (`after`: where a forced call may start)."""
    rendered, specs = template_tools(tools)
    mode, named = _choice(choice, specs)
    if mode != "none" and not specs:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    try:  # each schema checked (meta-schema, llguidance) off the event loop, before the engine
        checks = [
            Constraint(
                StructuredOutput(kind="json_schema", spec=json.dumps(s.parameters)), f"tools[{i}].function.parameters"
            )
            for i, s in enumerate(specs)
        ]
    except RecursionError:
        raise bad_request("a tool's parameters are nested too deeply", param="tools", code="invalid_schema") from None
    setup = ToolSetup(template_tools=rendered, checks=checks)
    if mode == "none":
        return setup
    if cfg.tool_parser is None:
        raise bad_request(
            "tool calling needs a tool-call parser; this server runs with --tool-call-parser none "
            "(send tool_choice none to only show the tools to the model)",
            param="tool_choice",
        )
    parser = get(cfg.tool_parser)
    many = parallel is not False and mode != "function"
    setup.parsing = ParsingSpec(
        tools=parser, max_calls=None if many else 1, drop=cfg.eos_text if cfg.keeps_specials() else ""
    )
    setup.keep_specials = cfg.keeps_specials()
    if mode == "auto":
        return setup
    forced = [ToolSpec(s.name, closed_schema(s.parameters)) for s in specs if named in (None, s.name)]
    lark = parser.grammar(forced, many, cfg.marker, prefix="/\\n{0,2}/" if after else "")
    setup.forced = Constraint(StructuredOutput(kind="grammar", spec=lark, after_token_ids=after), "tools")
    return setup
