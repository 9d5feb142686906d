"""Request latency breakdown: where a request's time goes, stage by stage.

Stages in request order: tokenize, TM → Scheduler hop, queue, prefill, decode,
Scheduler → Detokenizer hop, detokenize, Detokenizer → TM hop; embeddings requests have a row
of their own (end to end, queue and prefill by kind, throughput).  Quantile panels have
exemplars on, so a slow point opens its trace in Tempo (datasource link on `trace_id`).
"""

from __future__ import annotations

from dashboards import promql as q
from dashboards.panels import Board, latency_panel, timeseries_panel

HOP = "sightline_ipc_hop_latency_seconds"
# (legend, histogram, extra matcher) in the order a request meets them
STAGES = (
    ("tokenize", "sightline_request_tokenize_time_seconds", ""),
    ("hop TM → Scheduler", HOP, 'hop="tm_to_scheduler"'),
    ("queue", "sightline_request_queue_time_seconds", ""),
    ("prefill", "sightline_request_prefill_time_seconds", ""),
    ("decode", "sightline_request_decode_time_seconds", ""),
    ("hop Scheduler → Detokenizer", HOP, 'hop="scheduler_to_detokenizer"'),
    ("detokenize", "sightline_request_detokenize_time_seconds", ""),
    ("hop Detokenizer → TM", HOP, 'hop="detokenizer_to_tm"'),
)


def _mean(histogram: str, matcher: str) -> str:
    return q.mean(histogram, *filter(None, [matcher]))


def board() -> Board:
    b = Board(
        "sightline-latency",
        "Sightline / Request latency breakdown",
        "Per-stage request latency — stacked means and quantiles — with exemplars linking to traces.",
    )
    b.row(
        "Where the time goes",
        timeseries_panel(
            "Mean time per stage (stacked)",
            "Mean seconds per request in each stage, stacked in request order. The hop stages are "
            "means per message (a request crosses the output hops once per output batch).",
            "s",
            [(_mean(h, m), legend) for legend, h, m in STAGES],
            stack=True,
            width=16,
            height=10,
        ),
        timeseries_panel(
            "Share of TTFT per stage",
            "Mean tokenize, queue and prefill time as a share of mean TTFT: which stage to fix first "
            "when time to first token is high.",
            "percentunit",
            [
                (f"({_mean(h, '')})\n/\n({q.mean('sightline_time_to_first_token_seconds')})", legend)
                for legend, h, _ in (STAGES[0], STAGES[2], STAGES[3])
            ],
            stack=True,
            width=8,
            height=10,
            max_value=1,
        ),
    )
    b.row(
        "Stages (p50 / p90 / p99, exemplars on)",
        *(
            latency_panel(legend.capitalize(), f"Quantiles of the {legend} stage per request.", h, width=8)
            for legend, h, m in STAGES
            if not m
        ),
    )
    embed, size = "sightline_embedding_request_latency_seconds", "sightline_embedding_request_size"
    b.row(
        "Embeddings (POST /v1/embeddings, /encode, /v1/rerank, /v1/score)",
        latency_panel(
            "Embeddings end to end",
            "Quantiles of an embeddings request's time from the HTTP handler to "
            "its vectors in the TokenizerManager (every input of the request pooled).",
            embed,
            'kind="e2e"',
            width=8,
        ),
        latency_panel(
            "Embeddings queue and prefill",
            "Per embeddings request: its longest-waiting input's time in "
            "the Scheduler's queue, and first admission → last input pooled (p50/p90/p99 and mean by "
            "kind).",
            embed,
            'kind=~"queue|prefill"',
            by=("kind",),
            width=8,
        ),
        timeseries_panel(
            "Embeddings throughput",
            "Embeddings requests, inputs and input tokens per second.",
            "ops",
            [
                (q.rate(f"{embed}_count", 'kind="e2e"'), "requests/s"),
                (q.rate(f"{size}_sum", 'kind="inputs"'), "inputs/s"),
                (q.rate(f"{size}_sum", 'kind="tokens"'), "tokens/s"),
            ],
            width=8,
        ),
    )
    b.row(
        "IPC hops",
        latency_panel(
            "IPC hops",
            "Receiver's receive stamp − sender's `sent_at`, per ZMQ hop (p50/p90/p99 and "
            "mean per hop). scheduler_stats is the stats/heartbeat message.",
            HOP,
            by=("hop",),
            width=24,
        ),
    )
    return b
