"""Chat messages and chat-template options of a chat request, as the template renders them.

Messages become the plain dicts Hugging Face templates read.  As vLLM does, an assistant
message's `tool_calls[].function.arguments` (a JSON string on the wire) becomes a dict
before rendering, since templates iterate it (`arguments | items`, `tojson`); a tool
message keeps its `tool_call_id` and `name`; `reasoning_content` is passed for templates
that render it.  A null content (an assistant message that only calls tools) renders as
the empty string: most templates concatenate it.
"""

from __future__ import annotations

import json
from typing import Any

from serving.frontend.errors import bad_request
from serving.frontend.http.routes.openai_requests import CHAT_ROLES, ChatMessage
from serving.frontend.tokenizer_manager.chat_template import ChatTemplateOptions, check_options


def _content(i: int, m: ChatMessage) -> str:
    if isinstance(m.content, list):
        if any(p.type != "text" or p.text is None for p in m.content):
            raise bad_request(f"messages[{i}].content: only text parts are supported", param="messages")
        return "".join(p.text or "" for p in m.content)
    if m.content is None and m.role != "assistant":  # OpenAI allows null only on an assistant's message
        raise bad_request(f"messages[{i}].content is required for a {m.role} message", param="messages")
    return m.content or ""


def _tool_calls(i: int, m: ChatMessage) -> list[dict[str, Any]]:
    if m.role != "assistant":
        raise bad_request(f"messages[{i}].tool_calls is only allowed on assistant messages", param="messages")
    calls = []
    for j, call in enumerate(m.tool_calls or []):
        if call.function is None:
            raise bad_request(f"messages[{i}].tool_calls[{j}].function is required", param="messages")
        args = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON", param="messages"
                ) from None
        calls.append(
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.function.name, "arguments": args},
            }
        )
    return calls


def chat_messages(raw: list[ChatMessage]) -> list[dict[str, Any]]:
    if not raw:
        raise bad_request("messages must contain at least one message", param="messages", code="empty_prompt")
    messages = []
    for i, m in enumerate(raw):
        if m.role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}", param="messages"
            )
        if m.audio is not None or m.function_call is not None:
            name = "audio" if m.audio is not None else "function_call"
            raise bad_request(
                f"messages[{i}].{name} is not supported by this server", param="messages", code="unsupported_parameter"
            )
        out: dict[str, Any] = {"role": m.role, "content": _content(i, m)}
        if m.name is not None:
            out["name"] = m.name
        if m.tool_calls:
            out["tool_calls"] = _tool_calls(i, m)
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            out["reasoning_content"] = m.reasoning_content
        messages.append(out)
    return messages


def template_options(req: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> ChatTemplateOptions:
    """The chat-template fields of a chat request or a /tokenize body, checked (400 naming the field);
    `tools`: the request's tools as the template renders them (openai_tools)."""
    cont = bool(getattr(req, "continue_final_message", None))
    add = getattr(req, "add_generation_prompt", None)
    opts = ChatTemplateOptions(
        add_generation_prompt=(not cont) if add is None else add,
        continue_final_message=cont,
        kwargs=dict(getattr(req, "chat_template_kwargs", None) or {}),
        documents=getattr(req, "documents", None),
        chat_template=getattr(req, "chat_template", None),
        tools=tools,
    )
    check_options(opts, messages)
    return opts
