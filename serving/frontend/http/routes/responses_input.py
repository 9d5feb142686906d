"""A `/v1/responses` body → the chat request the chat route builds (`openai_api.chat_input`), so that a
Responses turn runs through the same checks, template, constraints, tool parser and pipeline as a chat one.

- `instructions` → a leading system message (not carried over from `previous_response_id`, as OpenAI);
- `input` (a string, or items: messages with text parts, `function_call`, `function_call_output`;
  `reasoning` items are dropped, the template renders no earlier thinking) → chat messages, after the
  stored conversation of `previous_response_id` (responses_store);
- `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`, `user`/`safety_identifier`
  and vLLM's sampling extensions → the chat fields of the same meaning;
- `tools` (function tools, flat) and `tool_choice` (`{"type": "function", "name"}`) → chat's nested form;
- `text.format` (`json_schema` with its schema flat, `json_object`, `text`) → `response_format`.
Everything else OpenAI defines is refused with a 400 naming it.  A 400 raised by the chat builders (or
by the TokenizerManager) names the Responses field (`responses_error`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from serving.frontend.errors import APIError, bad_request
from serving.frontend.http.routes.openai_api import Front, chat_input, unsupported
from serving.frontend.http.routes.openai_requests import ChatCompletionRequest
from serving.frontend.http.routes.responses_requests import ResponsesRequest
from serving.frontend.http.routes.responses_store import StoredResponse
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput

ROUTE = "/v1/responses"
_REFUSED = (
    "background",
    "background_options",
    "conversation",
    "context_management",
    "prompt",
    "reasoning",
    "top_logprobs",
    "max_tool_calls",
    "prompt_cache_retention",
    "prompt_cache_options",
    "moderation",
    "access_programs",
    "image",
)
_PASSED = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "safety_identifier",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "speculative",
    "service_tier",
    "stream",
)
_TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")
# chat's field names → the Responses field a 400 names (param and message alike)
_RENAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format(\.type)?\b"), "text.format"),
    (re.compile(r"\bmessages\b"), "input"),
    (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
)


def _rename(text: str) -> str:
    for pattern, new in _RENAMES:
        text = pattern.sub(new, text)
    return text


def responses_error(err: APIError) -> APIError:
    """A 400 of the chat builders or the TokenizerManager, naming the Responses field instead."""
    err.message = _rename(err.message)
    err.param = _rename(err.param) if err.param else err.param
    return err


@dataclass
class Turn:
    """What one create request adds to a conversation: the chat messages it ran on (without its
    instructions; the next turn's context) and its input as items (GET .../input_items)."""

    messages: list[dict]
    items: list[dict]
    previous: StoredResponse | None = None
    call_names: dict[str, str] = field(default_factory=dict)  # call_id → function name, earlier turns' included
    echo: dict = field(default_factory=dict)  # the request's settings, echoed on the response object


def _text(content: Any, where: str) -> str:
    """A message's content (`where`: its path): a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                param=f"{where}[{j}].type",
                code="unsupported_parameter",
            )
        out.append(part["text"])
    return "".join(out)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} is required (a string)", param=f"{where}.{name}")
    return value


def normalize(raw: str | list[Any] | None) -> list[dict]:
    """`input` as items (a string is one user message); each item keeps what it was sent with."""
    if raw is None:
        raise bad_request("input is required", param="input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not raw:
        raise bad_request("input must contain at least one item", param="input", code="empty_prompt")
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object (an item)", param=f"input[{i}]")
    return [{"type": "message", **item} if "type" not in item else item for item in raw]


def to_messages(items: list[dict], names: dict[str, str]) -> list[dict]:
    """Items → chat messages; `names`: call_id → function name, so a tool message names its function
    (filled in from the calls seen, the earlier turns' included)."""
    out: list[dict] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(
                    f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name = _field(item, "call_id", where), _field(item, "name", where)
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments") or "{}"},
            }
            if out and out[-1]["role"] == "assistant":  # one assistant message: its text and every call
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            msg = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        elif kind != "reasoning":
            raise bad_request(
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
    return out


def chat_tools(raw: list[Any] | None) -> list[Any] | None:
    """Responses' flat function tools → chat's `{"type": "function", "function": {...}}`; no built-in tools."""
    if not raw:  # an empty list (the Agents SDK's, without tools) is no tools
        return None
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}].type {kind!r} is not supported: this server runs function tools only",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported (auto, none, required or a function)",
            param="tool_choice",
            code="unsupported_parameter",
        )
    return choice


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise bad_request(
                "text.format.schema is required with type json_schema",
                param="text.format.schema",
                code="invalid_schema",
            )
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}}
    return {"type": fmt.type}


def _refusals(body: ResponsesRequest) -> None:
    for name in _REFUSED:
        unsupported(getattr(body, name) is not None, name, name)
    unsupported(bool(body.include), "include", "include")
    unsupported(body.truncation not in (None, "disabled"), "truncation", "truncation other than disabled")
    unsupported(
        body.text is not None and body.text.verbosity not in (None, "medium"),
        "text.verbosity",
        "text.verbosity other than medium",
    )


def responses_input(
    body: ResponsesRequest, front: Front, previous: StoredResponse | None
) -> tuple[GenerateReqInput, Turn]:
    """The internal request of one create call, and its turn (`previous`: the stored response it continues)."""
    _refusals(body)
    items = normalize(body.input)
    names = dict(previous.call_names) if previous is not None else {}
    history = list(previous.messages) if previous is not None else []
    conversation = history + to_messages(items, names)
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {k: getattr(body, k) for k in _PASSED if getattr(body, k) is not None}
    chat.update(
        model=body.model,
        messages=head + conversation,
        max_completion_tokens=body.max_output_tokens,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        response_format=_response_format(body),
    )
    try:
        req = msgspec.convert({k: v for k, v in chat.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid request: {_rename(str(exc))}", code="invalid_type") from None
    req.ignored_fields = list(getattr(body, "ignored_fields", []))
    obj = chat_input(req, front, ROUTE)
    obj.param_names = {"max_new_tokens": "max_output_tokens"}
    obj.constraints = [replace(c, param=_rename(c.param)) for c in obj.constraints]
    for i, item in enumerate(items):
        item.setdefault("id", f"{'msg' if item['type'] == 'message' else 'item'}_{uuid.uuid4().hex}")
        items[i] = item
    return obj, Turn(conversation, items, previous, names, _echo(body))


def _echo(body: ResponsesRequest) -> dict:
    """The request's settings as the response object repeats them."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tools": list(body.tools or []),
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {
            "format": {k: v for k, v in msgspec.structs.asdict(fmt).items() if v is not None}
            if fmt is not None
            else {"type": "text"}
        },
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "metadata": dict(body.metadata or {}),
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "safety_identifier": body.safety_identifier,
    }
