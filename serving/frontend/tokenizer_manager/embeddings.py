"""Embeddings requests in the TokenizerManager: validate, tokenize every input, send one
`TokenizedEmbeddingReqInput`, and finish the request when its `EmbeddingOut` arrives.

One HTTP request is one `ReqState` here (one rid in `rid_to_state`, one admission and tenant
charge for all its tokens, one outcome); the Scheduler runs each input as its own
prefill-only engine request and answers once (`serving.engine.embed_groups`).

Checks, each a 400 before anything reaches the engine: the server serves embeddings
(`Ready.pooling`, from `--pooling` or an embedding model), at most `--max-embedding-inputs`
inputs, none empty, every input within the context window unless `truncate_prompt_tokens`
(vLLM's field: keep the last k tokens; -1 the context window) truncates it (an encoder keeps the
first k-1 and the last, as a BERT tokenizer truncates: [CLS] ... [SEP]), `dimensions`
within the model's hidden size.  Post-processing (`finish_vectors`): truncation to
`dimensions` (Matryoshka-style), then L2 normalisation when `normalize` (the model's default:
its sentence-transformers Normalize module; true with `--pooling` on a generative model).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.io_struct import (
    BatchEmbeddingOutput,
    EmbeddingOut,
    Ready,
    ReqMeta,
    Stamps,
    TokenizedEmbeddingReqInput,
)
from serving.frontend.engine_state import check_available
from serving.frontend.errors import APIError, bad_request
from serving.frontend.tenants.gate import refused
from serving.frontend.tenants.namespace import cache_namespace, check_salt
from serving.frontend.tenants.priority import engine_priority
from serving.frontend.tokenizer_manager.req_state import ReqState
from telemetry.clock import now_ns

TokenizerManager = Any  # serving.frontend.tokenizer_manager.manager's, which imports this module

EMBEDDINGS = "embeddings"  # the requests' gen_ai.operation.name


@dataclass
class EmbedReqInput:
    """One embeddings request as the HTTP layer hands it over."""

    inputs: list[str] | list[list[int]]
    param: str = "input"  # the API's name of the inputs field (for errors)
    normalize: bool | None = None  # None: the model's default
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    rid: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    user: str | None = None
    timeout: float | None = None
    encoding_format: str = "float"
    messages: None = None  # what the flight recorder reads of a generation request
    stop: list[str] = field(default_factory=list)

    @property
    def prompt(self) -> list:
        return self.inputs

    def record_params(self) -> dict[str, Any]:
        """What the flight recorder keeps of it (and replay sends again)."""
        return {"inputs": len(self.inputs), "normalize": self.normalize, "dimensions": self.dimensions,
                "truncate_prompt_tokens": self.truncate_prompt_tokens, "encoding_format": self.encoding_format}


class _Text:
    """One text input as `PromptTokenizer.encode` takes a prompt."""

    messages = None

    def __init__(self, text: str) -> None:
        self.prompt = text


def truncate(ids: list[int], keep: int, encoder: bool) -> list[int]:
    """At most `keep` tokens: the last ones (vLLM's rule), or for an encoder its first `keep - 1` and its last
    token, so a tokenized input stays `[CLS] ... [SEP]` as the tokenizer's own truncation leaves it."""
    if len(ids) <= keep:
        return ids
    if not encoder:
        return ids[-keep:]
    return ids[:keep - 1] + ids[-1:] if keep > 1 else ids[:1]


async def tokenize(tm: TokenizerManager, obj: EmbedReqInput, ready: Ready) -> list[list[int]]:
    context_len, vocab_size, max_chars = ready.context_len, ready.vocab_size, tm.input_limits(ready).max_chars
    out = []
    k = obj.truncate_prompt_tokens
    if k is not None and not (k == -1 or 1 <= k <= context_len):
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {context_len}]", param="truncate_prompt_tokens")
    keep = context_len if k == -1 else k
    for i, item in enumerate(obj.inputs):
        if isinstance(item, str):
            if len(item) > max_chars:
                raise bad_request(f"input {i} has {len(item)} characters; it cannot fit the {context_len}-token "
                                  "context", param=obj.param, code="context_length_exceeded")
            ids = await tm.prompts.encode(_Text(item), vocab_size)
        else:
            ids = list(item)
            if any(not 0 <= t < vocab_size for t in ids):
                raise bad_request(f"token ids must be in [0, {vocab_size})", param=obj.param, code="invalid_token_id")
        if not ids:
            raise bad_request(f"input {i} is empty", param=obj.param, code="empty_prompt")
        if keep is not None:
            ids = truncate(ids, keep, ready.encoder)
        if len(ids) > context_len:
            raise bad_request(f"This model's maximum context length is {context_len} tokens, but input {i} has "
                              f"{len(ids)} tokens; shorten it or set truncate_prompt_tokens", param=obj.param,
                              code="context_length_exceeded")
        out.append(ids)
    return out


async def submit(tm: TokenizerManager, obj: EmbedReqInput, state: ReqState) -> ReqState:
    """`TokenizerManager.submit` for embeddings; raises APIError (4xx/503) before anything is sent."""
    ready = check_available(tm.engine, tm.oldest_arrival())
    if not ready.pooling:
        raise bad_request("this model does not serve embeddings: start the server with --pooling last|mean|cls, or "
                          "serve an embedding model", param=obj.param, code="embeddings_not_supported")
    if not obj.inputs:
        raise bad_request(f"{obj.param} is empty", param=obj.param, code="empty_prompt")
    if len(obj.inputs) > tm.args.max_embedding_inputs:
        raise bad_request(f"at most {tm.args.max_embedding_inputs} inputs per request (--max-embedding-inputs), got "
                          f"{len(obj.inputs)}", param=obj.param, code="too_many_inputs")
    if obj.dimensions is not None and not 1 <= obj.dimensions <= ready.hidden_size:
        raise bad_request(f"dimensions must be in [1, {ready.hidden_size}] for this model", param="dimensions")
    if obj.normalize is None:
        obj.normalize = ready.normalize
    check_salt(obj.cache_salt)
    namespace = cache_namespace(tm.args.prefix_cache_sharing, state.tenant, obj.cache_salt)
    tenant = tm.policy(state.tenant)
    if obj.priority is not None and not -1000 <= obj.priority <= 1000:
        raise bad_request("priority must be an integer in [-1000, 1000]", param="priority")
    priority = engine_priority(tm.args.priority_order, tenant.priority, obj.priority)
    tm.admission.check_queue()
    rid = uuid.uuid4().hex
    t0 = now_ns()
    inputs = await tokenize(tm, obj, ready)
    t1 = now_ns()
    ready = check_available(tm.engine, tm.oldest_arrival())
    tokens = sum(map(len, inputs))
    tm.admission.check_queue()
    tm.admission.check_tokens(tokens, others_in_flight=bool(tm.rid_to_state))
    if tm.tenants is not None and (refusal := await tm.tenants.acquire(state.tenant, rid, tokens)):
        tm.tel.shed(f"tenant_{refusal.limit}")
        raise refused(refusal)
    state.rid, state.client_rid, state.prompt_tokens, state.budget_tokens = rid, obj.rid or rid, tokens, tokens
    state.embed_inputs = len(inputs)
    tm.tel.tokenized(state, t0, t1)
    carrier, producer = tm.tel.producer(state)
    state.meta = ReqMeta(trace=carrier, stamps=Stamps(arrival=state.arrival, tokenized=now_ns()))
    tm.rid_to_state[rid] = state
    tm.admission.admit(tokens)
    state.dp_rank = tm.dispatcher.pick(inputs[0], tokens, namespace)
    if obj.timeout:
        state.timer = asyncio.get_running_loop().call_later(
            obj.timeout, tm.abort, rid, "timeout", f"the request timed out after {obj.timeout:g} s")
    tm.transport.send(TokenizedEmbeddingReqInput(rid=rid, inputs=inputs, pooling=ready.pooling, meta=state.meta,
                                                 worker=tm.worker, priority=priority, cache_namespace=namespace),
                      state.dp_rank)
    if producer is not None:
        producer.end()
    return state


def handle_output(tm: TokenizerManager, batch: BatchEmbeddingOutput) -> None:
    """Each `EmbeddingOut` finishes its request (one message, the whole answer)."""
    for out in batch.outputs:
        state = tm.rid_to_state.get(out.rid)
        if state is None:
            tm.drops.drop("BatchEmbeddingOutput", out.rid, out.meta.trace)
            continue
        state.meta, state.embedding = out.meta, out
        state.cached_tokens, state.cpu_ns = out.cached_tokens, out.cpu_ns
        if not state.started:
            state.started = True
            tm.admission.started()
        tm._finish(state, "stop", None, None)
        state.event.set()


async def collect(tm: TokenizerManager, state: ReqState) -> tuple[EmbeddingOut | None, APIError | None]:
    """The request's result, or the error it ended with (an engine error, a timeout, a shutdown...)."""
    from serving.frontend.errors import result_error

    last = None
    async for out in tm.stream(state):
        last = out
    if state.embedding is not None:
        return state.embedding, None
    err = result_error(last.finish_reason if last else "error", last.error if last else "the request was aborted",
                       state.status)
    return None, err or APIError(500, "the request ended without its embeddings", type="internal_error")


def finish_vectors(out: EmbeddingOut, dimensions: int | None, normalize: bool) -> list[np.ndarray]:
    """The vectors the client gets: truncated to `dimensions`, then L2-normalised if asked."""
    vectors = []
    for data in out.embeddings:
        v = np.frombuffer(data, dtype="<f4")
        if dimensions is not None:
            v = v[:dimensions]
        if normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        vectors.append(v.astype(np.float32, copy=False))
    return vectors
