"""The OpenAI request bodies as typed structs, decoded by msgspec, every field nullable.

Every field OpenAI's chat and completions schemas define is here, and vLLM's extensions
clients send to it: a field this server cannot honour is still declared, so the builders
(`openai_api`) refuse it with a 400 naming it instead of msgspec dropping it unseen.  A
field declared nowhere is unknown: `decode_body` strips it and records it on the struct,
and the builder refuses it (400 `unknown_parameter`) unless `--allow-unknown-fields`.
`null` means "the default" wherever OpenAI allows it, so fields are `X | None = None` and
the builders resolve defaults (some from generation_config.json).
"""

from __future__ import annotations

from typing import Any

import msgspec

from serving.frontend.errors import bad_request, from_decode_error

# forbid: an unknown field fails decoding (decode_body strips and records it); dict: room for that record
_STRICT = {"kw_only": True, "forbid_unknown_fields": True, "dict": True}


class StreamOptions(msgspec.Struct, **_STRICT):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: the running usage on every chunk (benchmark clients)


class JsonSchemaFormat(msgspec.Struct, **_STRICT):
    """`response_format.json_schema`: the schema is enforced whatever `strict` says (constrained decoding)."""

    name: str | None = None
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, **_STRICT):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, **_STRICT):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, json_object."""

    json: Any = None  # a JSON Schema, as an object or as JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's) or GBNF
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # json: no whitespace between tokens (compact JSON)
    whitespace_pattern: str | None = None  # json: the regex whitespace between tokens must match
    disable_additional_properties: bool | None = None  # json: objects closed unless they say (default: true)
    # vLLM's, declared to be refused by name
    disable_fallback: Any = None
    structural_tag: Any = None


class _SamplingFields(msgspec.Struct, **_STRICT):
    """What both routes share: OpenAI's sampling fields and vLLM's extensions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the end user's id: on the request's span and record
    # vLLM's extensions
    cache_salt: str | None = None  # narrows the prefix-cache namespace (--prefix-cache-sharing)
    priority: int | None = None  # --priority-order; at best the tenant's (docs/api.md)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None  # false: never speculated (--speculative)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # declared to be refused by name: vLLM's retired guided_* fields (see structured_outputs), LoRA
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    lora_request: Any = None


class CompletionRequest(_SamplingFields, **_STRICT):
    prompt: str | list[Any]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(msgspec.Struct, **_STRICT):
    """A part of a message's content: only text parts are rendered (others refused by type)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class ToolCallFunction(msgspec.Struct, **_STRICT):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; templates iterate a dict


class ToolCall(msgspec.Struct, **_STRICT):
    id: str | None = None
    type: str | None = "function"
    function: ToolCallFunction | None = None


class ChatMessage(msgspec.Struct, **_STRICT):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, rendered by the template
    tool_call_id: str | None = None  # a tool message's answer to one of them
    reasoning_content: str | None = None  # vLLM's: an assistant's earlier reasoning, for templates that render it
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None  # the deprecated form of tool_calls


class ChatCompletionRequest(_SamplingFields, **_STRICT):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # each checked by openai_tools (a 400 names `tools[i].…`)
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's chat-template fields
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, Any]] | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# unknown fields counted by name in sightline_request_fields_ignored_total (others as `other`): fields other
# OpenAI-compatible servers accept that this one does not declare
FOREIGN_FIELDS = frozenset(
    {
        "add_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "length_penalty",
        "use_beam_search",
        "allowed_token_ids",
        "bad_words",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "kv_transfer_params",
        "vllm_xargs",
        "mm_processor_kwargs",
        "request_id",
        "echo",
        "guided_decoding",
        "regex",
        "json_schema",
        "ebnf",
        "lora_path",
        "return_hidden_states",
        "separate_reasoning",
        "rid",
        "custom_logit_processor",
        "no_stop_trim",
        "stream_reasoning",
        "top_a",
        "tfs",
        "typical_p",
        "mirostat",
    }
)


def decode_body(body: bytes, typ: type) -> Any:
    """The typed body; unknown fields are stripped and listed in its `ignored_fields` attribute
    (dotted paths), for the builder to refuse or, under --allow-unknown-fields, to count."""
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return _with_ignored(msgspec.json.decode(body, type=typ), [])
    except msgspec.ValidationError as exc:
        if not str(exc).startswith("Object contains unknown field"):
            raise from_decode_error(exc) from None
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:  # msgspec's own depth limit (about 1000 levels), not ours to raise
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    try:  # the typed decode stopped at the unknown field: the rest may still be malformed, or too deep
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    ignored: list[str] = []
    while True:  # each pass strips one unknown field, so it ends
        try:
            return _with_ignored(msgspec.convert(raw, type=typ), ignored)
        except msgspec.ValidationError as exc:
            name, where = _unknown(str(exc))
            if name is None or not _strip(raw, where, name):
                raise from_decode_error(exc) from None
            ignored.append(f"{where}.{name}" if where else name)
        except RecursionError:
            raise bad_request("request body is nested too deeply", code="invalid_json") from None


def _with_ignored(obj: Any, ignored: list[str]) -> Any:
    if hasattr(obj, "__dict__"):  # a struct declared with dict=True (other bodies refuse nothing here)
        obj.ignored_fields = ignored
    return obj


def _unknown(message: str) -> tuple[str | None, str]:
    """(field, path) of msgspec's "Object contains unknown field `x` - at `$.messages[0]`"."""
    if not message.startswith("Object contains unknown field `"):
        return None, ""
    name = message.split("`", 2)[1]
    at = message.split(" - at `$", 1)
    return name, (at[1].rstrip("`").lstrip(".") if len(at) == 2 else "")


def _strip(raw: Any, where: str, name: str) -> bool:
    """Delete `name` from the object at `where` (a msgspec path like `messages[0].tool_calls[1]`)."""
    node = raw
    for part in where.replace("]", "").replace("[", ".").split(".") if where else []:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return False
    if not isinstance(node, dict) or name not in node:
        return False
    del node[name]
    return True
