"""Replayed bodies of the routes that embed and generate nothing: /v1/embeddings, rerank and score.

The flight recorder keeps such a request's inputs in order (with --dump-content; a rerank's query then
its documents, a score's text_1 then its text_2) and, in its params, what else its body said
(`EmbedReqInput.record_params`): a replay sends the same route the same body.  Without content the
inputs are synthetic, as many as recorded, the recorded prompt tokens spread over them: token ids for
/v1/embeddings (exact), text for rerank and score, which take only text (exact when the served model's
tokenizer counts them, else about a word a token).
"""

from __future__ import annotations

import random
from typing import Any, Callable

from loadtest.replay.schedule import EMBEDDINGS, RERANK_PATHS, SCORE_PATHS

TOKEN_ID_RANGE = (1000, 20000)  # synthetic token-id inputs without a tokenizer (as loadtest/workloads.py)
EMBEDDING_OPTIONS = ("normalize", "dimensions", "truncate_prompt_tokens", "encoding_format")
# (tokens, seed) → (a text of about that many tokens, its count as the server counts it; None: unknown)
TextOf = Callable[[int, str], tuple[str, int | None]]


def synthetic_inputs(route: str, params: dict, n_tokens: int, seed: str, text_of: TextOf) -> tuple[list, int | None]:
    """(the inputs, their tokens as the server will count them; None: not known without a tokenizer)."""
    k = max(1, int(params.get("inputs") or 1))
    sizes = [max(1, n_tokens // k + (i < n_tokens % k)) for i in range(k)]
    if route == EMBEDDINGS:
        rng = random.Random(seed)
        return [[rng.randint(*TOKEN_ID_RANGE) for _ in range(m)] for m in sizes], sum(sizes)
    texts = [text_of(m, f"{seed}-{i}") for i, m in enumerate(sizes)]
    counts = [c for _, c in texts]
    return [t for t, _ in texts], None if None in counts else sum(counts)


def _split(items: list, n: int | None) -> Any:
    """A recorded text field: a list of `n` items, or (None) the one string the client sent."""
    return items[:n] if n is not None else items[0]


def pooling_body(route: str, params: dict, inputs: list, model: str) -> dict:
    """The body that sends `inputs` to `route` again with the recorded options."""
    p = params or {}
    opts = {k: p[k] for k in ("truncate_prompt_tokens",) if p.get(k) is not None}
    if route in RERANK_PATHS:
        docs = [{"text": d} for d in inputs[1:]] if p.get("document_objects") else inputs[1:]
        body = {"model": model, "query": inputs[0], "documents": docs, **opts}
        for key in ("top_n", "return_documents"):
            if p.get(key) is not None:
                body[key] = p[key]
        return body
    if route in SCORE_PATHS:
        n1 = p.get("text_1")
        first = 1 if n1 is None else n1
        return {"model": model, "text_1": _split(inputs, n1), "text_2": _split(inputs[first:], p.get("text_2")), **opts}
    return {"model": model, "input": inputs, **{k: p[k] for k in EMBEDDING_OPTIONS if p.get(k) is not None}}
