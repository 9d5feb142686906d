"""One finished request as the client saw it: the unit every number in a report comes from.

The Locust users append one JSON line per request to `records.jsonl`; the summary, the
plots, the SLO gate and the reconciliation all read these lines back, so percentiles
are exact (not Locust's rounded histogram) and any report can be recomputed later.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    workload: str
    endpoint: str  # chat | completions | embeddings (a replay's also generate, messages, responses)
    stage: int  # index of the load stage in effect when the request was sent
    level: float  # that stage's offered load: users (closed loop) or requests/s (Poisson)
    start: float  # wall-clock seconds (time.time()) when the request was sent
    e2e: float  # sent → end of the stream ([DONE]) or of the failure, seconds
    # HTTP status as the server counts it: the response's; for a mid-stream error event the status
    # its type stands for (503 server_unavailable...); 499 when the client cut the stream; 0: no response
    status: int = 0
    finish_reason: str = "abort"  # stop | length | abort | error (the server's label values)
    error: str | None = None  # why it failed: "http 400 context_length_exceeded", "error event ...", ...
    ttft: float | None = None  # sent → first chunk carrying text (or a finish_reason), seconds
    chunk_times: list[float] = field(default_factory=list)  # offsets of every text chunk, seconds
    prompt_tokens: int | None = None  # from the usage chunk (stream_options.include_usage)
    completion_tokens: int | None = None
    # usage.prompt_tokens_details.cached_tokens: prompt tokens the server's prefix cache served;
    # None when the usage chunk had no such field (a server without a prefix cache)
    cached_tokens: int | None = None
    inputs: int | None = None  # an embeddings request's: vectors received
    # cut by the client (Locust stopping, a timeout) before any response: the server may have counted it
    # (abort/499) or never have seen it (the request was still being connected or sent)
    unanswered: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """Exact from usage; the text-chunk count only if the server sent no usage."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive text chunks (vLLM's ITL: pooled over requests by the caller)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e − TTFT) / (n − 1), vLLM's per-request TPOT; None below two tokens."""
        n = self.output_tokens
        if self.ttft is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def token_times(recs: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(wall time of each text chunk, output tokens it stands for): a request's tokens spread evenly
    over its chunks, since a chunk may carry more than one token and usage gives only the total.
    Failed requests count too (one token a chunk, having no usage): the server did stream them."""
    times: list[float] = []
    weights: list[float] = []
    for r in recs:
        if r.chunk_times:
            times += [r.start + c for c in r.chunk_times]
            weights += [r.output_tokens / len(r.chunk_times)] * len(r.chunk_times)
    return times, weights


def load_records(path: Path) -> list[RequestRecord]:
    if not path.exists():
        return []
    return [RequestRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
