"""Client vs server: scrape `/metrics` before and after a run and compare what both counted.

Request counts by finish reason must match exactly (every request the client sent
ended once on the server); token counts must match the usage chunks; the server's TTFT
(handler entry → first token in the TokenizerManager) is never above the client's
(request sent → first text chunk), so at every histogram bucket bound the server's
cumulative count is at least the client's.  Server percentiles are estimated from
bucket deltas the way PromQL's `histogram_quantile` does.  With a prefix cache on the
server, the `cached_tokens` of the usage chunks must add up to exactly the increase of
`sightline_prefix_cache_hits_tokens_total`, and hits ÷ queries over the run is the hit
ratio; a server without that counter skips the check with a note.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.records import RequestRecord
from loadtest.server import auth_headers

REQUESTS = "sightline_requests_total"
PROMPT = "sightline_prompt_tokens_total"
GENERATION = "sightline_generation_tokens_total"
TTFT = "sightline_time_to_first_token_seconds"
IN_FLIGHT = "sightline_requests_in_flight"
PREFIX_HITS = "sightline_prefix_cache_hits_tokens_total"
PREFIX_QUERIES = "sightline_prefix_cache_queries_tokens_total"
EMBED_LATENCY = "sightline_embedding_request_latency_seconds"
EMBED_SIZE = "sightline_embedding_request_size"
Labels = tuple[tuple[str, str], ...]


@dataclass
class Scrape:
    """Every sample of one `/metrics` answer, by (sample name, sorted labels)."""

    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    text: str = ""  # the exposition as scraped (saved in the results folder)

    @classmethod
    def parse(cls, text: str) -> "Scrape":
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(out, text)

    def by(self, name: str, key: str, **match: str) -> dict[str, float]:
        """Sum of `name` samples grouped by one label, over samples whose labels match."""
        out: Counter = Counter()
        for (n, labels), v in self.samples.items():
            d = dict(labels)
            if n == name and all(d.get(k) == val for k, val in match.items()):
                out[d.get(key, "")] += v
        return dict(out)

    def total(self, name: str, **match: str) -> float:
        return sum(self.by(name, "__none__", **match).values())

    def minus(self, before: "Scrape") -> "Scrape":
        return Scrape({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})


def scrape(url: str, timeout: float = 10.0) -> Scrape | None:
    """None when the server has no /metrics (or it is not Prometheus text)."""
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", headers=auth_headers(), timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or REQUESTS not in r.text:
        return None
    return Scrape.parse(r.text)


def scrape_settled(url: str, model: str, timeout: float = 15.0) -> Scrape | None:
    """Scrape once nothing is in flight and the request counter stopped moving (the server's
    bookkeeping of the last requests may trail the client's [DONE] by a moment)."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        now = scrape(url)
        if now is None:
            return None
        settled = now.total(IN_FLIGHT, model_name=model) == 0
        if settled and last is not None and last.by(REQUESTS, "finish_reason") == now.by(REQUESTS, "finish_reason"):
            return now
        if time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.3)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's estimate from cumulative bucket counts {upper bound: count} (+Inf included)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank, prev_bound, prev_count = q * buckets[bounds[-1]], 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return prev_bound
            span = buckets[b] - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / span if span else 1.0)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


@dataclass
class Reconciliation:
    available: bool
    note: str = ""
    client_by_finish_reason: dict[str, int] = field(default_factory=dict)
    server_by_finish_reason: dict[str, int] = field(default_factory=dict)
    server_by_finish_reason_status: dict[str, int] = field(default_factory=dict)
    client_by_finish_reason_status: dict[str, int] = field(default_factory=dict)
    client_unanswered: int = 0  # aborts cut before any response: the server counts each as abort, or never saw it
    counts_match: bool = False
    client_prompt_tokens: int = 0
    server_prompt_tokens: int = 0
    client_generation_tokens: int = 0
    server_generation_tokens: int = 0
    tokens_match: bool = False
    tokens_comparable: bool = True  # False when a request failed after admission: its tokens are unknown here
    client_ttft_count: int = 0
    server_ttft_count: int = 0
    ttft_ms: dict[str, dict[str, float | None]] = field(default_factory=dict)  # p50/p90/p99: client, server
    server_ttft_le_client: bool = False  # at every bucket bound, server cumulative count ≥ client's
    prefix_cache_available: bool = False  # the server exposes sightline_prefix_cache_hits_tokens_total
    client_cached_tokens: int = 0  # Σ usage.prompt_tokens_details.cached_tokens of successful requests
    server_prefix_hits_tokens: int = 0  # increase of sightline_prefix_cache_hits_tokens_total
    server_prefix_queries_tokens: int = 0  # increase of sightline_prefix_cache_queries_tokens_total
    cached_tokens_match: bool = False
    prefix_hit_ratio: float | None = None  # server hits ÷ queries over the run; None without queries
    # embeddings requests: the client's successful ones vs the server's e2e observations, their inputs vs its sizes
    client_embedding_requests: int = 0
    server_embedding_requests: int = 0
    client_embedding_inputs: int = 0
    server_embedding_inputs: int = 0
    embeddings_match: bool = True

    @property
    def ok(self) -> bool:
        cached = self.cached_tokens_match or not self.prefix_cache_available
        tokens = (self.tokens_match and cached) or not self.tokens_comparable
        return self.available and self.counts_match and tokens and self.server_ttft_le_client and self.embeddings_match


def reconcile(
    recs: list[RequestRecord],
    before: Scrape | None,
    after: Scrape | None,
    model: str,
    client_ttft_ms: dict[str, float | None],
) -> Reconciliation:
    if before is None or after is None:
        return Reconciliation(False, "the server has no /metrics with sightline_requests_total")
    d = after.minus(before)
    rec = Reconciliation(True)
    rec.client_by_finish_reason = dict(Counter(r.finish_reason for r in recs))
    rec.client_by_finish_reason_status = dict(Counter(f"{r.finish_reason}/{r.status}" for r in recs))
    rec.server_by_finish_reason = {k: int(v) for k, v in d.by(REQUESTS, "finish_reason", model_name=model).items() if v}
    by_status: Counter = Counter()
    for (n, labels), v in d.samples.items():
        lab = dict(labels)
        if n == REQUESTS and lab.get("model_name") == model and v:
            by_status[f"{lab.get('finish_reason')}/{lab.get('status')}"] += int(v)
    rec.server_by_finish_reason_status = dict(by_status)
    rec.client_unanswered = sum(r.unanswered for r in recs)
    rec.counts_match = counts_match(rec.client_by_finish_reason, rec.server_by_finish_reason, rec.client_unanswered)
    ok = [r for r in recs if r.ok]
    rec.client_prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    rec.client_generation_tokens = sum(r.completion_tokens or 0 for r in ok)
    rec.server_prompt_tokens = int(d.total(PROMPT, model_name=model))
    rec.server_generation_tokens = int(d.total(GENERATION, model_name=model))
    rec.tokens_match = (rec.client_prompt_tokens, rec.client_generation_tokens) == (
        rec.server_prompt_tokens,
        rec.server_generation_tokens,
    )
    # a request refused with an HTTP error has no tokens on either side; one that failed mid-stream
    # has tokens the server counted and the client never got a usage chunk for
    rec.tokens_comparable = all(r.ok or (r.error or "").startswith("http ") for r in recs)
    notes = []
    if rec.client_unanswered:
        notes.append(
            f"{rec.client_unanswered} request(s) cut before any response: the server's aborts may count each or not"
        )
    if not rec.tokens_comparable:
        notes.append("requests failed mid-stream (no usage chunk): token counts are shown, not compared")
    prefix_cache(rec, ok, after, d, model)
    if not rec.prefix_cache_available:
        notes.append(f"the server has no {PREFIX_HITS}: cached tokens are not compared")
    rec.note = "; ".join(notes)
    buckets = {float(le): v for le, v in d.by(TTFT + "_bucket", "le", model_name=model).items()}
    client_ttft = sorted(r.ttft for r in recs if r.ttft is not None and r.ok)
    rec.client_ttft_count, rec.server_ttft_count = len(client_ttft), int(d.total(TTFT + "_count", model_name=model))
    for q in ("p50", "p90", "p99"):
        server = histogram_quantile(int(q[1:]) / 100, buckets)
        rec.ttft_ms[q] = {"client": client_ttft_ms.get(q), "server_estimate": server * 1000 if server else None}
    embeddings(rec, recs, d, model)
    rec.server_ttft_le_client = (bool(buckets) or not client_ttft) and all(
        buckets[b] >= sum(t <= b for t in client_ttft) for b in buckets if b != float("inf")
    )
    return rec


def counts_match(client: dict[str, int], server: dict[str, int], unanswered: int) -> bool:
    """Equal per finish reason, except that the server's aborts may lack up to `unanswered` of the client's:
    a request cut while it was still being connected or sent never reached the server."""
    others = {k: v for k, v in client.items() if k != "abort"} == {k: v for k, v in server.items() if k != "abort"}
    aborts = client.get("abort", 0)
    return others and aborts - unanswered <= server.get("abort", 0) <= aborts


def prefix_cache(rec: Reconciliation, ok: list[RequestRecord], after: Scrape, delta: Scrape, model: str) -> None:
    """Cached tokens of the usage chunks vs the server's prefix-cache hits, and the hit ratio."""
    rec.prefix_cache_available = any(n == PREFIX_HITS for n, _ in after.samples)
    rec.client_cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    if not rec.prefix_cache_available:
        return
    rec.server_prefix_hits_tokens = int(delta.total(PREFIX_HITS, model_name=model))
    rec.server_prefix_queries_tokens = int(delta.total(PREFIX_QUERIES, model_name=model))
    rec.cached_tokens_match = rec.client_cached_tokens == rec.server_prefix_hits_tokens
    if rec.server_prefix_queries_tokens > 0:
        rec.prefix_hit_ratio = rec.server_prefix_hits_tokens / rec.server_prefix_queries_tokens


def embeddings(rec: Reconciliation, recs: list[RequestRecord], delta: Scrape, model: str) -> None:
    """Successful embeddings requests and their inputs vs the server's embedding families: exact when every
    embeddings request succeeded (a failed one may or may not have reached the engine); else shown only."""
    embed = [r for r in recs if r.endpoint == "embeddings"]
    ok = [r for r in embed if r.ok]
    rec.client_embedding_requests = len(ok)
    rec.client_embedding_inputs = sum(r.inputs or 0 for r in ok)
    rec.server_embedding_requests = int(delta.total(EMBED_LATENCY + "_count", model_name=model, kind="e2e"))
    rec.server_embedding_inputs = int(delta.total(EMBED_SIZE + "_sum", model_name=model, kind="inputs"))
    if len(ok) == len(embed):
        rec.embeddings_match = (rec.client_embedding_requests, rec.client_embedding_inputs) == (
            rec.server_embedding_requests,
            rec.server_embedding_inputs,
        )
