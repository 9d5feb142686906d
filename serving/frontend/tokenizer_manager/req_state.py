"""One request in the main process: what the HTTP layer hands the TokenizerManager
(`GenerateReqInput`), everything known about it while it lives (`ReqState`), and a
finished result (`Collected`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.io_struct import Logprobs, ReqMeta, SpecCounts, Stamps, StrOut
from protocol.sampling_params import SamplingParams
from serving.frontend.output_parsing import ParsingSpec
from serving.frontend.tokenizer_manager.chat_template import ChatTemplateOptions
from serving.frontend.tokenizer_manager.grammar_check import Constraint
from telemetry.request_slo import Objectives
from telemetry.request_trace import RequestTrace


class OutputParser(Protocol):
    """What the TokenizerManager asks of a choice's output parsing (serving.frontend.output_parsing):
    each output's text in order, and at the end the finish reason the client is told."""

    def feed(self, text: str, tokens: int) -> None: ...

    def finish(self, reason: str) -> str: ...


@dataclass
class GenerateReqInput:
    """One request as the HTTP layer hands it over (prompt, messages or token ids)."""

    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_new_tokens: int | None = None  # None: up to the context window
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    stream: bool = False
    rid: str | None = None
    param_names: dict[str, str] = field(default_factory=dict)  # engine field → API field, for errors
    timeout: float | None = None  # seconds until the request is aborted with a timeout error
    cache_salt: str | None = None  # narrows the prefix-cache namespace (vLLM's field)
    priority: int | None = None  # lowers the tenant's priority for this request (never raises it)
    user: str | None = None  # OpenAI's end-user id: on the span and the request record
    n: int = 1  # choices per prompt: the route submits one sub-request per choice (and per prompt of `batch`)
    batch: list[str | list[int]] | None = None  # /v1/completions with several prompts (then `prompt` is None)
    echo: bool = False  # the response repeats the prompt (and its logprobs, with sampling.prompt_logprobs)
    prompt_logprobs_field: bool = False  # vLLM's `prompt_logprobs` asked: returned as the choice's own field
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    param_sources: dict[str, str] = field(default_factory=dict)  # sampling field -> request | generation_config |
    # default: where its effective value came from (on the span and in /debug/requests)
    template: ChatTemplateOptions | None = None  # how `messages` are rendered (vLLM's chat-template fields)
    ignored_fields: list[str] = field(default_factory=list)  # unknown body fields ignored (--allow-unknown-fields)
    constraints: list[Constraint] = field(default_factory=list)  # structured-output specs checked before the
    # engine, each with the field a 400 names (`sampling.structured` is the last)
    parsing: ParsingSpec | None = None  # chat: how the answer is read (reasoning, tool calls)


@dataclass
class ReqState:
    """Everything about one request, from the HTTP handler's first line to the end of its
    response (SGLang's ReqState, with its telemetry): one object, each fact once.

    The HTTP layer creates it (`route`, `arrival`), telemetry opens its span (in `trace`, which only
    telemetry reads and writes),
    `TokenizerManager.submit` gives it its rid and puts it in `rid_to_state`, outputs
    accumulate in `out_list`, and the TM's `forget` sets the outcome exactly once.
    """

    route: str
    operation: str  # gen_ai.operation.name
    arrival: int  # monotonic ns: the HTTP handler was entered
    stream: bool = False
    tenant: str = "default"  # the tenant its API key names (auth middleware): usage, limits, cache namespace
    slo: Objectives | None = None  # its latency objectives (headers, else its tenant's): judged at its end
    # -- identity and admission (TokenizerManager.submit) --
    rid: str = ""  # internal: always a fresh uuid, used to route
    client_rid: str = ""  # what the client calls it (its `rid`, else ours): echoed, never used to route
    prompt_tokens: int = 0
    prompt_ids: list[int] | None = None  # kept only when the response needs them (echo, prompt logprobs)
    cached_tokens: int = 0  # of the prompt, reused from the engine's prefix cache
    retractions: int = 0  # times the engine took it out of the batch (KV ran out) and resumed it
    speculative: SpecCounts | None = None  # speculated (--speculative): draft tokens proposed and accepted, steps
    budget_tokens: int = 0  # KV tokens the Scheduler first expects it to need (ServerArgs.expected_tokens), counted
    # against --max-inflight-tokens and in its dp rank's load
    dp_rank: int = 0  # the Scheduler rank that runs it
    meta: ReqMeta = field(default_factory=lambda: ReqMeta(trace={}, stamps=Stamps()))  # the latest seen
    timer: asyncio.TimerHandle | None = None
    # -- outputs --
    out_list: list[StrOut] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    started: bool = False  # the engine produced its first output (it no longer counts as queued)
    completion_tokens: int = 0
    cpu_ns: int = 0  # its share of the engine steps' CPU time so far (per-tenant usage)
    # -- its telemetry: span and trace ids, receive stamps, outcome, the flight recorder's input and output --
    trace: RequestTrace = field(default_factory=RequestTrace)
    # -- outcome (set once, by TokenizerManager.forget) --
    finished: bool = False
    finish_reason: str | None = None
    status: int = 200  # the HTTP status it ends with (serving.frontend.errors.http_status)
    breakdown: dict | None = None  # the latency breakdown returned to the client
    # -- embeddings (serving.frontend.tokenizer_manager.embeddings) --
    embed_inputs: int = 0  # inputs of an embeddings request
    embedding: Any = None  # its protocol.io_struct.EmbeddingOut, once it arrived
    # -- where its effective sampling values came from (GenerateReqInput.param_sources): /debug/requests --
    param_sources: dict[str, str] = field(default_factory=dict)
    # -- chat answers read for reasoning and tool calls (serving.frontend.output_parsing) --
    parsing: OutputParser | None = None
    tool_call_failure: tuple[str, str] | None = None  # (parser, text): its tool calls did not parse


@dataclass
class Collected:
    """A finished request, for non-streaming responses."""

    rid: str  # as the client knows it (ReqState.client_rid)
    text: str
    output_ids: list[int]
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None
    cached_tokens: int = 0
    logprobs: Logprobs | None = None  # of `output_ids` (sampling.logprobs set)
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1..n-1 (sampling.prompt_logprobs set)


def join_logprobs(parts: list[Logprobs]) -> Logprobs | None:
    """One run of logprobs from a request's successive outputs (None when it asked for none)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return Logprobs(
        token_logprobs=[x for p in parts for x in p.token_logprobs],
        top_ids=[x for p in parts for x in p.top_ids],
        top_logprobs=[x for p in parts for x in p.top_logprobs],
    )
