"""Relevance on an embedding model: rerank (Jina / Cohere / vLLM) and score (vLLM), by cosine similarity.

    POST /v1/rerank (also /rerank, /v2/rerank)   `query`, `documents` (strings or `{"text": ...}`), `top_n`
                          (0 or absent: every document), `return_documents` (default true) →
                          `{id, model, usage, results: [{index, relevance_score, document?}]}`, best first.
    POST /v1/score (also /score)                  `text_1` (a string or a list), `text_2` (a string or a list):
                          one text_1 scored against every text_2, or lists of one length pairwise →
                          `{id, object: "list", created, model, data: [{index, object: "score", score}], usage}`.

The served model is an embedding model (a bi-encoder, not a cross-encoder): each text is embedded on
its own and a pair's score is the cosine similarity of the two vectors, in [-1, 1].  Every text of a
request is one input of one embeddings request (`embeddings_endpoint`: one admission, one rid, the
embeddings telemetry under the route's own label), so the query counts against --max-embedding-inputs
with the documents.  A server that serves no embeddings answers 400 `embeddings_not_supported`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from protocol.io_struct import EmbeddingOut
from serving.frontend.errors import bad_request
from serving.frontend.http.routes.embeddings import PoolingExtensions, check_model, embeddings_endpoint, usage_of
from serving.frontend.http.state import ServerState
from serving.frontend.tokenizer_manager.embeddings import EmbedReqInput, finish_vectors
from serving.frontend.tokenizer_manager.req_state import ReqState


class RerankDocument(msgspec.Struct):
    text: str


class RerankRequest(PoolingExtensions, kw_only=True):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    user: str | None = None


class ScoreRequest(PoolingExtensions, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise bad_request(f"{param} is empty", param=param, code="empty_prompt")
    return texts


def _request(body: Any, texts: list[str], names: list[str], param: str, route_params: dict) -> EmbedReqInput:
    """One embeddings request of every text, each normalised (a dot product is then the cosine)."""
    for text, name in zip(texts, names):
        if not text:
            raise bad_request(f"{name} is empty", param=name, code="empty_prompt")
    return EmbedReqInput(
        texts,
        param,
        True,
        None,
        body.truncate_prompt_tokens,
        body.rid,
        body.cache_salt,
        body.priority,
        body.user,
        route_params=route_params,
        names=names,
    )


def rerank_input(body: RerankRequest, state: ServerState) -> tuple[EmbedReqInput, RerankRequest]:
    check_model(body.model, state)
    if not body.documents:
        raise bad_request("documents is empty", param="documents", code="empty_prompt")
    if body.top_n is not None and body.top_n < 0:
        raise bad_request("top_n must be >= 0 (0: every document)", param="top_n")
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    names = ["query", *(f"documents[{i}]" for i in range(len(docs)))]
    objects = any(isinstance(d, RerankDocument) for d in body.documents)
    params = {"top_n": body.top_n, "return_documents": body.return_documents, "document_objects": objects}
    return _request(body, [body.query, *docs], names, "documents", params), body


def score_input(body: ScoreRequest, state: ServerState) -> tuple[EmbedReqInput, list[tuple[int, int]]]:
    """The inputs are text_1's texts then text_2's; returns the pairs to score as indices into them."""
    check_model(body.model, state)
    t1, t2 = _texts(body.text_1, "text_1"), _texts(body.text_2, "text_2")
    if len(t1) == 1:
        pairs = [(0, 1 + j) for j in range(len(t2))]
    elif len(t1) == len(t2):
        pairs = [(i, len(t1) + i) for i in range(len(t1))]
    else:
        raise bad_request(
            f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or lists of one "
            "length (scored pairwise)",
            param="text_1",
        )
    names = [f"text_1[{i}]" for i in range(len(t1))] + [f"text_2[{j}]" for j in range(len(t2))]
    params = {
        "text_1": len(t1) if isinstance(body.text_1, list) else None,
        "text_2": len(t2) if isinstance(body.text_2, list) else None,
    }
    return _request(body, t1 + t2, names, "text_2", params), pairs


def _vectors(out: EmbeddingOut) -> np.ndarray:
    return np.stack(finish_vectors(out, None, True)).astype(np.float64)


def rerank_result(
    out: EmbeddingOut, obj: EmbedReqInput, body: RerankRequest, req: ReqState, state: ServerState
) -> dict:
    v = _vectors(out)
    scores = v[1:] @ v[0]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if body.top_n:
        order = order[: body.top_n]
    results = [
        {
            "index": i,
            "relevance_score": float(scores[i]),
            **({"document": {"text": obj.inputs[1 + i]}} if body.return_documents else {}),
        }
        for i in order
    ]
    return {
        "id": f"rerank-{req.rid}",
        "model": state.model_name,
        "usage": usage_of(out),
        "results": results,
        "sightline": req.breakdown,
    }


def score_result(
    out: EmbeddingOut, obj: EmbedReqInput, pairs: list[tuple[int, int]], req: ReqState, state: ServerState
) -> dict:
    v = _vectors(out)
    data = [{"index": k, "object": "score", "score": float(v[a] @ v[b])} for k, (a, b) in enumerate(pairs)]
    return {
        "id": f"score-{req.rid}",
        "object": "list",
        "created": int(time.time()),
        "model": state.model_name,
        "data": data,
        "usage": {**usage_of(out), "completion_tokens": 0},
        "sightline": req.breakdown,
    }


async def rerank(request: Request) -> Response:
    """Served at each of its paths; the route label is the path the client used (one of those)."""
    return await embeddings_endpoint(request, request.url.path, RerankRequest, rerank_input, rerank_result)


async def score(request: Request) -> Response:
    return await embeddings_endpoint(request, request.url.path, ScoreRequest, score_input, score_result)
