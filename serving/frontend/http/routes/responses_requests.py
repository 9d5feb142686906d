"""The body of `POST /v1/responses` (OpenAI's Responses API) as a typed struct, decoded by msgspec.

Every field of OpenAI's `ResponseCreateParams` is declared: the ones this server honours are typed, the
others (`Any`) are declared so that `responses_input` refuses them with a 400 naming them instead of
msgspec dropping them unseen; an undeclared field is unknown (400 `unknown_parameter` unless
`--allow-unknown-fields`), as on the chat route.  `input` items and `tools` stay loose (`Any`): they
are unions by `type`, read one by one so that a 400 names `input[3].call_id` or `tools[0].type`.
"""

from __future__ import annotations

from typing import Any

import msgspec

_STRICT = {"kw_only": True, "forbid_unknown_fields": True, "dict": True}


class TextFormat(msgspec.Struct, **_STRICT):
    """`text.format`: `text`, `json_object`, or `json_schema` with its schema flat on the object."""

    type: str
    name: str | None = None
    schema: Any = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, **_STRICT):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponseStreamOptions(msgspec.Struct, **_STRICT):
    include_obfuscation: bool | None = None  # OpenAI pads deltas against side channels; nothing to pad here


class ResponsesRequest(msgspec.Struct, **_STRICT):
    input: str | list[Any] | None = None
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint at OpenAI: the prefix cache here needs none
    # vLLM's sampling extensions, as its Responses route accepts them (and a replay sends them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None  # false: never speculated (--speculative)
    # declared to be refused by name
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    context_management: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    access_programs: Any = None
    image: Any = None
