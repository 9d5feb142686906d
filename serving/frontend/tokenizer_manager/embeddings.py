"""Embeddings requests in the TokenizerManager: what it checks and tokenizes before sending one
`TokenizedEmbeddingReqInput` (admitted and sent as a generation request is,
`TokenizerManager.submit_embeddings`), and the vectors the client gets once its `EmbeddingOut`
has finished the request.

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

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np

from protocol.io_struct import EmbeddingOut, Ready, StrOut
from serving.frontend.errors import APIError, bad_request, result_error
from serving.frontend.tokenizer_manager.req_state import ReqState
from serving.frontend.tokenizer_manager.tokenization import PromptTokenizer

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
    # a route's own fields beside its inputs (rerank's top_n...), kept by the flight recorder so replay
    # sends that route's body again as it was
    route_params: dict[str, Any] = field(default_factory=dict)
    names: list[str] | None = None  # each input's name in the route's body (`query`, `documents[2]`), for errors

    def where(self, i: int) -> tuple[str, str]:
        """(how an error names input i, its param)."""
        return (self.names[i], self.names[i]) if self.names else (f"input {i}", self.param)

    @property
    def prompt(self) -> list:
        return self.inputs

    def record_params(self) -> dict[str, Any]:
        """What the flight recorder keeps of it (and replay sends again)."""
        return {
            "inputs": len(self.inputs),
            "normalize": self.normalize,
            "dimensions": self.dimensions,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "encoding_format": self.encoding_format,
            **self.route_params,
        }


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
    return ids[: keep - 1] + ids[-1:] if keep > 1 else ids[:1]


def check(obj: EmbedReqInput, ready: Ready, max_inputs: int) -> None:
    """What can be checked before tokenizing (400s); sets `normalize` to the model's default if unset."""
    if not ready.pooling:
        raise bad_request(
            "this model does not serve embeddings: start the server with --pooling last|mean|cls, or "
            "serve an embedding model",
            param=obj.param,
            code="embeddings_not_supported",
        )
    if not obj.inputs:
        raise bad_request(f"{obj.param} is empty", param=obj.param, code="empty_prompt")
    if len(obj.inputs) > max_inputs:
        raise bad_request(
            f"at most {max_inputs} inputs per request (--max-embedding-inputs), got {len(obj.inputs)}",
            param=obj.param,
            code="too_many_inputs",
        )
    if obj.dimensions is not None and not 1 <= obj.dimensions <= ready.hidden_size:
        raise bad_request(f"dimensions must be in [1, {ready.hidden_size}] for this model", param="dimensions")
    if obj.normalize is None:
        obj.normalize = ready.normalize


async def tokenize(prompts: PromptTokenizer, obj: EmbedReqInput, ready: Ready, max_chars: int) -> list[list[int]]:
    """Every input's token ids, truncated as asked; 400 on an empty, oversized or out-of-vocabulary input."""
    context_len, vocab_size = ready.context_len, ready.vocab_size
    out = []
    k = obj.truncate_prompt_tokens
    if k is not None and not (k == -1 or 1 <= k <= context_len):
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {context_len}]", param="truncate_prompt_tokens")
    keep = context_len if k == -1 else k
    for i, item in enumerate(obj.inputs):
        name, param = obj.where(i)
        if isinstance(item, str):
            if len(item) > max_chars:
                raise bad_request(
                    f"{name} has {len(item)} characters; it cannot fit the {context_len}-token context",
                    param=param,
                    code="context_length_exceeded",
                )
            ids = await prompts.encode(_Text(item), vocab_size)
        else:
            ids = list(item)
            if any(not 0 <= t < vocab_size for t in ids):
                raise bad_request(f"token ids must be in [0, {vocab_size})", param=obj.param, code="invalid_token_id")
        if not ids:
            raise bad_request(f"{name} is empty", param=param, code="empty_prompt")
        if keep is not None:
            ids = truncate(ids, keep, ready.encoder)
        if len(ids) > context_len:
            raise bad_request(
                f"This model's maximum context length is {context_len} tokens, but {name} has "
                f"{len(ids)} tokens; shorten it or set truncate_prompt_tokens",
                param=param,
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


async def collect(outputs: AsyncIterator[StrOut], state: ReqState) -> tuple[EmbeddingOut | None, APIError | None]:
    """The request's result, or the error it ended with (an engine error, a timeout, a shutdown...);
    `outputs`: `TokenizerManager.stream(state)`, which aborts the request if this reader goes away."""
    last = None
    async for out in outputs:
        last = out
    if state.embedding is not None:
        return state.embedding, None
    err = result_error(
        last.finish_reason if last else "error", last.error if last else "the request was aborted", state.status
    )
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
