"""An Anthropic Messages body (`anthropic_requests`) → the chat request the chat route builds from
(`ChatCompletionRequest`), then → `GenerateReqInput` by the chat route's own builder (`chat_input`):
one pipeline, one set of checks, defaults, templates, tool formats and grammars.

- `system` (a string or text blocks) → a leading system message.
- `messages`: user and assistant turns, starting with a user turn.  Text blocks → the turn's text;
  an assistant's `tool_use` blocks → its `tool_calls` (input as the arguments); a user's
  `tool_result` blocks → one `tool` message each, before the turn's text, each answering a
  `tool_use` of the assistant turn just before; an assistant's `thinking` → its
  `reasoning_content`.  A final assistant turn is continued (Anthropic's prefill), as
  `continue_final_message` continues it.
- `tools` (`input_schema`) → functions; `tool_choice` auto | any | tool | none → auto | required |
  the named function | none; `disable_parallel_tool_use` → `parallel_tool_calls: false`.
- `stop_sequences` → `stop`; `metadata.user_id` → `user`; `output_config.format` (a JSON Schema)
  → `response_format`.
"""

from __future__ import annotations

from typing import Any

from serving.frontend.errors import APIError, bad_request
from serving.frontend.http.routes.anthropic_requests import Block, CountTokensRequest, MessagesRequest
from serving.frontend.http.routes.openai_api import Front, chat_input, unsupported
from serving.frontend.http.routes.openai_requests import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    JsonSchemaFormat,
    ResponseFormat,
    ToolCall,
    ToolCallFunction,
)
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput

PARAMS = {"stop": "stop_sequences", "user": "metadata.user_id", "response_format": "output_config.format"}
ROUTE, COUNT_ROUTE = "/v1/messages", "/v1/messages/count_tokens"
TOOL_FIELDS = frozenset(
    {
        "name",
        "description",
        "input_schema",
        "type",
        "cache_control",
        "strict",
        "input_examples",
        "defer_loading",
        "allowed_callers",
        "eager_input_streaming",
    }
)  # those not rendered: ignored
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice type → OpenAI's
# the chat builder's names for what this API calls otherwise (in its messages)
RENAMES = (
    (".function.parameters", ".input_schema"),
    (".function.name", ".name"),
    ("max_completion_tokens", "max_tokens"),
    ("response_format.json_schema.schema", "output_config.format.schema"),
)


def _text(where: str, blocks: str | list[Block] | None) -> str:
    """A system prompt or tool result: a string or text blocks, as one string."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise bad_request(f"{where}[{j}]: only text blocks are supported here, got {b.type!r}", param=where)
    return "".join(b.text or "" for b in blocks)


def _tool_use(where: str, b: Block) -> ToolCall:
    if not b.id or not b.name or not isinstance(b.input, dict):
        raise bad_request(f"{where}: a tool_use block needs `id`, `name` and an object `input`", param=where)
    return ToolCall(id=b.id, function=ToolCallFunction(name=b.name, arguments=b.input))


def _turn(i: int, role: str, blocks: list[Block], called: set[str]) -> list[ChatMessage]:
    """One turn's chat messages; `called`: the tool_use ids of the assistant turn before (tool_results answer
    them)."""
    texts: list[ContentPart] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    thought = None
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = "assistant" if b.type in ("tool_use", "thinking") else "user" if b.type == "tool_result" else role
        if kind != role:
            raise bad_request(f"{where}: {b.type} blocks belong in {kind} turns, not {role} turns", param=where)
        if b.type == "text":
            if not b.text:
                raise bad_request(f"{where}: text content blocks must be non-empty", param=where)
            texts.append(ContentPart(type="text", text=b.text))
        elif b.type == "tool_use":
            calls.append(_tool_use(where, b))
        elif b.type == "tool_result":
            if b.tool_use_id not in called:
                raise bad_request(
                    f"{where}: tool_result for {b.tool_use_id!r}, which is not a tool_use id of the "
                    "assistant turn just before",
                    param=where,
                )
            results.append(
                ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_text(f"{where}.content", b.content))
            )
        elif b.type == "thinking":
            thought = (thought or "") + (b.thinking or "")
        else:
            raise bad_request(
                f"{where}: content blocks of type {b.type!r} are not supported by this server "
                "(text, tool_use, tool_result, thinking)",
                param=where,
            )
    out = results
    if texts or calls or thought is not None or not results:
        out.append(
            ChatMessage(
                role=role,
                content=texts or ("" if role == "user" else None),
                tool_calls=calls or None,
                reasoning_content=thought,
            )
        )
    return out


def prefill(body: CountTokensRequest | MessagesRequest) -> bool:
    """The last turn is the assistant's, with content: the answer continues it (an empty one is dropped)."""
    last = body.messages[-1] if body.messages else None
    return last is not None and last.role == "assistant" and bool(last.content)


def turns(body: CountTokensRequest | MessagesRequest) -> list[ChatMessage]:
    """The turns as chat messages (400 naming the turn and block at fault)."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    out = [ChatMessage(role="system", content=_text("system", body.system))] if body.system else []
    called: set[str] = set()
    last = body.messages[-1]
    kept = body.messages[:-1] if last.role == "assistant" and not last.content else body.messages
    for i, m in enumerate(kept):
        if m.role not in ("user", "assistant"):
            raise bad_request(
                f"messages[{i}].role: unexpected role {m.role!r}: the roles are user and assistant "
                "(a system prompt is the top-level `system`)",
                param=f"messages[{i}].role",
            )
        if i == 0 and m.role != "user":
            raise bad_request("messages[0].role: the first message must be a user turn", param="messages[0].role")
        if not m.content:
            raise bad_request(
                f"messages[{i}].content: all messages must have non-empty content except for an "
                "optional final assistant message",
                param=f"messages[{i}].content",
            )
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        out.extend(_turn(i, m.role, blocks, called))
        called = {b.id for b in blocks if b.type == "tool_use" and b.id} if m.role == "assistant" else set()
    return out


def _tools(raw: list[dict[str, Any]] | None) -> list[dict] | None:
    """Anthropic's custom tools as functions (the chat builder checks names and schemas); server tools refused."""
    if raw is None:
        return None
    out = []
    for i, t in enumerate(raw):
        if t.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools[{i}].type: {t.get('type')!r} tools are not supported by this server (custom tools only)",
                param=f"tools[{i}].type",
            )
        unknown = sorted(set(t) - TOOL_FIELDS)
        if unknown:
            raise bad_request(f"tools[{i}].{unknown[0]}: Extra inputs are not permitted", param=f"tools[{i}]")
        if "input_schema" not in t:
            raise bad_request(f"tools[{i}].input_schema: Field required", param=f"tools[{i}].input_schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    if raw is None:
        return None, None
    kind = raw.get("type")
    parallel = False if raw.get("disable_parallel_tool_use") else None
    if kind in CHOICES:
        return CHOICES[kind], parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    raise bad_request(
        'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}', param="tool_choice"
    )


def _output_format(cfg: dict[str, Any] | None) -> ResponseFormat | None:
    cfg = dict(cfg or {})
    unsupported(cfg.pop("effort", None) is not None, "output_config.effort", "output_config.effort")
    fmt = cfg.pop("format", None)
    if cfg:
        raise bad_request(f"output_config.{next(iter(cfg))}: unknown field", param="output_config")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise bad_request(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format"
        )
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt["schema"]))


def _refusals(body: CountTokensRequest | MessagesRequest, front: Front) -> None:
    if body.model != front.served:
        raise APIError(
            404,
            f"model: {body.model}: this server serves `{front.served}`",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    for name in (
        "mcp_servers",
        "context_management",
        "container",
        "inference_geo",
        "speed",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
    ):
        unsupported(getattr(body, name, None) is not None, name, name)
    unsupported(
        body.thinking is not None and body.thinking.get("type") != "disabled",
        "thinking",
        'extended thinking (thinking other than {"type": "disabled"})',
    )


def _chat_request(body: CountTokensRequest | MessagesRequest, front: Front) -> ChatCompletionRequest:
    _refusals(body, front)
    choice, parallel = _tool_choice(body.tool_choice)
    messages = turns(body)
    req = ChatCompletionRequest(
        messages=messages,
        model=body.model,
        tools=_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=_output_format(body.output_config),
        continue_final_message=prefill(body) or None,
    )
    req.ignored_fields = list(getattr(body, "ignored_fields", []))
    return req


def _renamed(err: APIError) -> APIError:
    """A chat builder's error in this API's field names."""
    for old, new in RENAMES:
        err.message = err.message.replace(old, new)
        err.param = err.param.replace(old, new) if err.param else err.param
    err.param = PARAMS.get(err.param or "", err.param)
    return err


def messages_input(body: MessagesRequest, front: Front) -> GenerateReqInput:
    """POST /v1/messages → the request the chat route would submit (400 naming the field, in this API's names)."""
    try:
        req = _chat_request(body, front)
        if body.max_tokens < 1:
            raise bad_request(f"max_tokens: must be >= 1, got {body.max_tokens}", param="max_tokens")
        if body.temperature is not None and not 0 <= body.temperature <= 1:
            raise bad_request(f"temperature: must be in [0, 1], got {body.temperature}", param="temperature")
        if body.stop_sequences is not None and any(not s for s in body.stop_sequences):
            raise bad_request("stop_sequences: each stop sequence must be non-empty", param="stop_sequences")
        unsupported(
            body.service_tier not in (None, "auto", "standard_only"),
            "service_tier",
            "service_tier other than auto or standard_only",
        )
        user = (body.metadata or {}).get("user_id")
        if user is not None and not isinstance(user, str):
            raise bad_request("metadata.user_id must be a string", param="metadata.user_id")
        req.max_tokens, req.stop, req.temperature, req.top_p = (
            body.max_tokens,
            body.stop_sequences,
            body.temperature,
            body.top_p,
        )
        req.top_k, req.stream, req.user, req.ignore_eos, req.seed = (
            body.top_k,
            body.stream,
            user,
            body.ignore_eos,
            body.seed,
        )
        req.speculative = body.speculative
        return chat_input(req, front, ROUTE)
    except APIError as err:
        raise _renamed(err) from None


def count_input(body: CountTokensRequest, front: Front) -> GenerateReqInput:
    """POST /v1/messages/count_tokens: the prompt the same body would render (no sampling)."""
    try:
        return chat_input(_chat_request(body, front), front, COUNT_ROUTE)
    except APIError as err:
        raise _renamed(err) from None
