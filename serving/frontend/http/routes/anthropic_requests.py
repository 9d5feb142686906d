"""The Anthropic Messages API's request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`) as
typed structs, decoded by the same `decode_body` as OpenAI's: a field declared nowhere is unknown
(400 `unknown parameter` unless `--allow-unknown-fields`), and a field this server cannot honour is
declared so that `anthropic_api` refuses it by name.

Content blocks are one loose struct (every block type's fields, all optional) so that a block of a
type this server does not render is refused by its `type` with its index, not as a decode error.
"""

from __future__ import annotations

from typing import Any

import msgspec

_STRICT = {"kw_only": True, "forbid_unknown_fields": True, "dict": True}


class Block(msgspec.Struct, **_STRICT):
    """One content block: text, tool_use, tool_result or thinking are rendered; any other type is refused."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking (an earlier turn's, passed back)
    signature: str | None = None
    cache_control: Any = None  # accepted and ignored: the prefix cache is automatic here
    citations: Any = None  # accepted on text blocks, not rendered
    # declared for other block types (image, document, redacted_thinking...), refused by type
    source: Any = None
    data: Any = None
    title: str | None = None
    context: str | None = None
    caller: Any = None


class Message(msgspec.Struct, **_STRICT):
    role: str
    content: str | list[Block]


class _Common(msgspec.Struct, **_STRICT):
    """What a create and a count_tokens body share: the prompt, as the template renders it."""

    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[dict[str, Any]] | None = None  # each checked by anthropic_api (a 400 names `tools[i].…`)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}
    output_config: dict[str, Any] | None = None  # `format` (a JSON Schema) is honoured, `effort` refused
    cache_control: Any = None  # accepted and ignored: the prefix cache is automatic here
    # declared to be refused by name
    mcp_servers: Any = None
    context_management: Any = None
    container: Any = None


class MessagesRequest(_Common, **_STRICT):
    max_tokens: int  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None  # `user_id`: the end user's id (OpenAI's `user`)
    service_tier: str | None = None  # auto | standard_only: one tier here
    # this server's extensions (vLLM's fields): a replay's exact output length, a reproducible draw
    ignore_eos: bool | None = None
    seed: int | None = None
    speculative: bool | None = None  # false: never speculated (--speculative)
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


class CountTokensRequest(_Common, **_STRICT):
    pass
