"""OpenAI-compatible request bodies (typed, decoded by msgspec) and response shapes.

Requests become a `GenerateReqInput` for the TokenizerManager; responses and SSE chunks
are plain dicts shaped exactly like OpenAI's (see docs/api.md).  Extensions accepted
as vLLM does: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
skip_special_tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.sampling_params import SamplingParams
from serving.frontend.errors import APIError, bad_request, from_decode_error
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the running usage on every chunk (benchmark clients ask for it)


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the end user's id: on the request's span and record
    cache_salt: str | None = None  # vLLM's: narrows the prefix-cache namespace (--prefix-cache-sharing)
    priority: int | None = None  # vLLM's field, our order: higher first, at most the tenant's (docs/api.md)
    # extensions, as vLLM / SGLang accept them
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True
    # other servers' fields this one refuses (400 unsupported_parameter) rather than ignore
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    lora_request: Any = None
    prompt_logprobs: Any = None


REFUSED_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                      "lora_request", "prompt_logprobs")


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def decode_body(body: bytes, typ: type) -> Any:
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise from_decode_error(exc) from None
    except RecursionError:  # msgspec's own depth limit (about 1000 levels), not ours to raise
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def _unsupported(cond: bool, param: str, what: str) -> None:
    if cond:
        raise bad_request(f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def _common(req: _SamplingFields, served: str, max_stop: int) -> tuple[SamplingParams, list[str]]:
    if req.model is not None and req.model != served:
        raise APIError(400, f"The model `{req.model}` does not exist; this server serves `{served}`",
                       param="model", code="model_not_found")
    if req.n != 1:
        raise bad_request(f"n must be 1 (got {req.n}): this server returns one choice per request", param="n")
    _unsupported(bool(req.logit_bias), "logit_bias", "logit_bias")
    for name in REFUSED_EXTENSIONS:
        _unsupported(getattr(req, name) is not None, name, name)
    if req.user is not None and len(req.user) > 256:
        raise bad_request("user must be at most 256 characters", param="user")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > max_stop:
        raise bad_request(f"at most {max_stop} stop strings are allowed, got {len(stop)}", param="stop")
    if any(not s or len(s) > 256 for s in stop):
        raise bad_request("each stop string must be 1 to 256 characters long", param="stop")
    params = SamplingParams(
        max_new_tokens=1, temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, seed=req.seed,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
    )
    return params, stop


def _max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise bad_request(f"{param} must be >= 1, got {value}", param=param)
    return value


def completion_input(req: CompletionRequest, served: str, max_stop: int) -> GenerateReqInput:
    params, stop = _common(req, served, max_stop)
    _unsupported(req.echo, "echo", "echo")
    _unsupported(req.best_of not in (None, 1), "best_of", "best_of > 1")
    _unsupported(req.suffix is not None, "suffix", "suffix")
    _unsupported(req.logprobs is not None, "logprobs", "logprobs")
    prompt: str | list[int]
    if isinstance(req.prompt, str):
        prompt = req.prompt
    elif req.prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in req.prompt):
        prompt = list(req.prompt)
    elif len(req.prompt) == 1 and isinstance(req.prompt[0], (str, list)):
        return completion_input(msgspec.structs.replace(req, prompt=req.prompt[0]), served, max_stop)
    elif not req.prompt:
        raise bad_request("prompt is empty", param="prompt", code="empty_prompt")
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a list with one of them "
                          "(batched prompts are not supported)", param="prompt")
    return GenerateReqInput(prompt=prompt, sampling=params, max_new_tokens=_max_tokens(req.max_tokens, "max_tokens"),
                            stop=stop, skip_special_tokens=req.skip_special_tokens, stream=req.stream,
                            param_names={"max_new_tokens": "max_tokens"}, **_tenancy(req))


def chat_input(req: ChatCompletionRequest, served: str, max_stop: int) -> GenerateReqInput:
    params, stop = _common(req, served, max_stop)
    _unsupported(req.logprobs or req.top_logprobs is not None, "logprobs", "logprobs")
    _unsupported(bool(req.tools), "tools", "tool calling")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        _unsupported(True, "response_format", "response_format other than text")
    if not req.messages:
        raise bad_request("messages must contain at least one message", param="messages", code="empty_prompt")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}",
                              param="messages")
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        messages.append({"role": m.role, "content": content})
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return GenerateReqInput(messages=messages, sampling=params, max_new_tokens=_max_tokens(limit, param), stop=stop,
                            skip_special_tokens=req.skip_special_tokens, stream=req.stream,
                            param_names={"max_new_tokens": param}, **_tenancy(req))


def _tenancy(req: _SamplingFields) -> dict:
    return {"cache_salt": req.cache_salt, "priority": req.priority, "user": req.user}


def include_usage(req: _SamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: _SamplingFields) -> bool:
    """`continuous_usage_stats`, honoured as vLLM honours it: only together with `include_usage`."""
    return include_usage(req) and req.stream_options.continuous_usage_stats
