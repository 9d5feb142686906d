"""OpenAI request bodies (`openai_requests`) → a `GenerateReqInput` for the TokenizerManager.

Every field is either honoured (mapped here; its range checked with a 400 naming it before
anything reaches the engine) or refused with a 400 naming it: none is dropped unseen
(docs/api.md has the table).  Defaults are resolved here, where `null` and "absent" are
the same, from the request, else the model's generation_config.json, else OpenAI's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from protocol.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from serving.frontend import reasoning
from serving.frontend.errors import APIError, bad_request
from serving.frontend.http.routes.openai_chat import chat_messages, template_options
from serving.frontend.http.routes.openai_requests import (
    FOREIGN_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    decode_body,  # noqa: F401 - the routes' decoder lives with the structs
)
from serving.frontend.http.routes.openai_structured import structured_output, with_start
from serving.frontend.http.routes.openai_tools import tool_setup
from serving.frontend.output_parsing import ParsingConfig, ParsingSpec
from serving.frontend.tokenizer_manager.generation_defaults import resolve
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions (chat's: up to the context window)


@dataclass
class Front:
    """What the builders need of the server: limits, defaults, and where ignored fields are counted."""

    served: str
    max_stop: int = 16
    max_n: int = 16
    max_choices: int = 64
    allow_unknown: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    count_ignored: Callable[[str, str], None] | None = None  # (route, field)
    trust_template: bool = False  # --trust-request-chat-template
    parsing: ParsingConfig = field(default_factory=ParsingConfig)  # --tool-call-parser, --reasoning-parser


def front_of(state: Any) -> Front:
    args, metrics = state.args, state.metrics
    count = (lambda route, name: metrics.fields_ignored.labels(route, name).inc()) if metrics is not None else None
    return Front(
        state.model_name,
        args.max_stop_strings,
        args.max_n,
        args.max_choices,
        args.allow_unknown_fields,
        state.tm.prompts.defaults,
        count,
        args.trust_request_chat_template,
        state.tm.prompts.parsing,
    )


def check_request_template(template: str | None, front: Front) -> None:
    """A request's own chat template runs as code here: only with --trust-request-chat-template (as vLLM)."""
    if template is not None and not front.trust_template:
        raise bad_request(
            "a request's own chat_template is refused by this server (start it with "
            "--trust-request-chat-template to accept it)",
            param="chat_template",
            code="chat_template_untrusted",
        )


def unsupported(cond: bool, param: str, what: str) -> None:
    if cond:
        raise bad_request(f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def check_ignored(req: Any, route: str, front: Front) -> list[str]:
    """Unknown fields: a 400 naming the first, or (--allow-unknown-fields) counted and returned."""
    ignored = getattr(req, "ignored_fields", [])
    if ignored and not front.allow_unknown:
        name = ignored[0]
        raise bad_request(
            f"unknown parameter `{name}`: this server does not know it (start it with "
            "--allow-unknown-fields to ignore unknown fields)",
            param=name,
            code="unknown_parameter",
        )
    for name in ignored:
        leaf = name.rsplit(".", 1)[-1]
        if front.count_ignored is not None:
            front.count_ignored(route, leaf if leaf in FOREIGN_FIELDS else "other")
    return list(ignored)


def _in_range(value: int | None, lo: int, hi: int, param: str) -> None:
    if value is not None and not lo <= value <= hi:
        raise bad_request(f"{param} must be in [{lo}, {hi}], got {value}", param=param)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string token ids → ints; each bias in [-100, 100] (the vocabulary bound is the engine's check)."""
    if not raw:
        return {}
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(raw)}", param="logit_bias")
    out = {}
    for key, value in raw.items():
        if not key.isdigit():
            raise bad_request(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}", param="logit_bias"
            )
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value!r} for {key}", param="logit_bias")
        out[int(key)] = float(value)
    return out


def _common(req: _SamplingFields, front: Front, default_max: int | None) -> tuple[SamplingParams, dict, dict]:
    """Sampling params and the GenerateReqInput fields both routes share."""
    if req.model is not None and req.model != front.served:
        raise APIError(
            400,
            f"The model `{req.model}` does not exist; this server serves `{front.served}`",
            param="model",
            code="model_not_found",
        )
    unsupported(req.lora_request is not None, "lora_request", "lora_request")
    _in_range(req.n, 1, front.max_n, "n")
    if req.user is not None and len(req.user) > 256:
        raise bad_request("user must be at most 256 characters", param="user")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > front.max_stop:
        raise bad_request(f"at most {front.max_stop} stop strings are allowed, got {len(stop)}", param="stop")
    if any(not s or len(s) > 256 for s in stop):
        raise bad_request("each stop string must be 1 to 256 characters long", param="stop")
    _in_range(req.prompt_logprobs, 0, MAX_LOGPROBS, "prompt_logprobs")
    _in_range(req.min_tokens, 0, 2**31 - 1, "min_tokens")
    sources: dict[str, str] = {}
    d = front.defaults
    params = SamplingParams(
        max_new_tokens=1,
        temperature=resolve("temperature", req.temperature, d, 1.0, sources),
        top_p=resolve("top_p", req.top_p, d, 1.0, sources),
        top_k=resolve("top_k", req.top_k, d, -1, sources),
        min_p=resolve("min_p", req.min_p, d, 0.0, sources),
        repetition_penalty=resolve("repetition_penalty", req.repetition_penalty, d, 1.0, sources),
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        speculative=req.speculative is not False,
        logit_bias=logit_bias(req.logit_bias),
        min_tokens=req.min_tokens or 0,
        prompt_logprobs=req.prompt_logprobs,
    )
    max_new = resolve("max_new_tokens", req.max_tokens, d, default_max, sources)
    fields = {
        "stop": stop,
        "skip_special_tokens": req.skip_special_tokens is not False,
        "stream": bool(req.stream),
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "user": req.user,
        "n": req.n or 1,
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "prompt_logprobs_field": req.prompt_logprobs is not None,
        "param_sources": sources,
        "max_new_tokens": max_new,
    }
    return params, fields, sources


def _check_max(value: int | None, param: str, allow_zero: bool, min_tokens: int | None) -> None:
    if value is not None and value < (0 if allow_zero else 1):
        extra = " (0 only with echo: true, to score the prompt alone)" if param == "max_tokens" else ""
        raise bad_request(f"{param} must be >= 1{extra}, got {value}", param=param)
    if value is not None and min_tokens and min_tokens > value:
        raise bad_request(f"min_tokens ({min_tokens}) must be at most {param} ({value})", param="min_tokens")


def _prompts(raw: str | list[Any]) -> list[str | list[int]]:
    """A completions `prompt`: a string, a token-id list, or a list of several of either."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise bad_request("prompt is empty", param="prompt", code="empty_prompt")
    if is_ids(raw):
        return [list(raw)]
    if all(isinstance(p, str) for p in raw) or all(is_ids(p) for p in raw):
        if any(not p for p in raw):
            raise bad_request("prompt contains an empty prompt", param="prompt", code="empty_prompt")
        return list(raw)
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list of strings or of token-id lists", param="prompt"
    )


def completion_input(req: CompletionRequest, front: Front, route: str = "/v1/completions") -> GenerateReqInput:
    ignored = check_ignored(req, route, front)
    params, fields, _ = _common(req, front, COMPLETION_MAX_TOKENS)
    unsupported(req.best_of not in (None, 1), "best_of", "best_of > 1")
    unsupported(req.suffix is not None, "suffix", "suffix")
    _in_range(req.logprobs, 0, MAX_LOGPROBS, "logprobs")
    _check_max(req.max_tokens, "max_tokens", bool(req.echo), req.min_tokens)
    params.logprobs = req.logprobs
    if req.echo and req.logprobs is not None:  # echo scores the prompt too, as OpenAI's legacy API does
        params.prompt_logprobs = max(req.logprobs, params.prompt_logprobs or 0)
    prompts = _prompts(req.prompt)
    n = fields["n"]
    if n * len(prompts) > front.max_choices:
        param = "n" if n > 1 else "prompt"
        raise bad_request(
            f"n x prompts = {n} x {len(prompts)} exceeds the limit of {front.max_choices} choices per "
            "request (--max-choices)",
            param=param,
            code="too_many_choices",
        )
    prompt, batch = (prompts[0], None) if len(prompts) == 1 else (None, prompts)
    constraints = structured_output(req)
    params.structured = constraints[0].so if constraints else None
    return GenerateReqInput(
        prompt=prompt,
        batch=batch,
        sampling=params,
        echo=bool(req.echo),
        param_names={"max_new_tokens": "max_tokens"},
        ignored_fields=ignored,
        constraints=constraints,
        **fields,
    )


def chat_input(req: ChatCompletionRequest, front: Front, route: str = "/v1/chat/completions") -> GenerateReqInput:
    ignored = check_ignored(req, route, front)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    req.max_tokens = limit
    params, fields, _ = _common(req, front, None)
    _check_max(limit, param, False, req.min_tokens)
    _chat_refusals(req)
    _in_range(req.top_logprobs, 0, MAX_LOGPROBS, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    params.logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.user is None and req.safety_identifier is not None:  # OpenAI's successor of `user`
        fields["user"] = req.safety_identifier[:256]
    check_request_template(req.chat_template, front)
    messages = chat_messages(req.messages)
    cfg = front.parsing
    thinking = reasoning.thinking_requested(req.chat_template_kwargs or {})
    after = cfg.think_end_ids if cfg.reasoning and thinking else ()  # constraints apply to the answer
    constraints = [with_start(c, after) for c in structured_output(req)]
    tools = tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls, cfg, after)
    if constraints and tools.forced is not None:
        raise bad_request(
            f"{constraints[0].param} and a forced tool_choice cannot be combined: the call's grammar is the constraint",
            param="tool_choice",
            code="conflicting_constraints",
        )
    main = constraints[0] if constraints else tools.forced
    params.structured = main.so if main is not None else None
    parsing = None
    if cfg.reasoning or tools.parsing is not None:
        base = tools.parsing or ParsingSpec()
        parsing = ParsingSpec(
            reasoning=cfg.reasoning, thinking=thinking, tools=base.tools, max_calls=base.max_calls, drop=base.drop
        )
    if tools.keep_specials:
        fields["skip_special_tokens"] = False
    return GenerateReqInput(
        messages=messages,
        sampling=params,
        param_names={"max_new_tokens": param},
        template=template_options(req, messages, tools.template_tools),
        ignored_fields=ignored,
        constraints=tools.checks + ([main] if main is not None else []),
        parsing=parsing,
        **fields,
    )


def _chat_refusals(req: ChatCompletionRequest) -> None:
    for name in ("functions", "function_call"):
        unsupported(getattr(req, name) is not None, name, f"the deprecated function calling ({name}: use tools)")
    for name in (
        "audio",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "verbosity",
        "metadata",
        "prompt_cache_key",
    ):
        unsupported(getattr(req, name) is not None, name, name)
    unsupported(req.modalities not in (None, ["text"]), "modalities", "modalities other than ['text']")
    unsupported(bool(req.store), "store", "store: true (stored completions)")
    unsupported(req.service_tier not in (None, "auto", "default"), "service_tier", "service_tier other than auto")


def include_usage(req: _SamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: _SamplingFields) -> bool:
    """`continuous_usage_stats`, honoured as vLLM honours it: only together with `include_usage`."""
    return include_usage(req) and bool(req.stream_options.continuous_usage_stats)
