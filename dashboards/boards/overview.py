"""Overview: is sightline serving, how fast, how loaded — the first board to open."""

from __future__ import annotations

from dashboards import promql as q
from dashboards.panels import Board, latency_panel, stat_panel, timeseries_panel

REQ = "sightline_requests_total"
ERRORS = 'status=~"5.."'


def board() -> Board:
    b = Board("sightline-overview", "Sightline / Overview",
              "Traffic, errors, latency and load of a sightline server at a glance.")
    b.row(
        "Traffic",
        timeseries_panel("Requests by status and finish reason",
                         "Generation requests ending per second, by HTTP status and finish reason (stop, length, "
                         "abort, error). 499 = the client went away; 5xx count against the availability SLO.",
                         "reqps", [(q.rate(REQ, by=("status", "finish_reason")), "{{status}} {{finish_reason}}")],
                         stack=True),
        timeseries_panel("Error ratio (5xx)",
                         "Share of ended generation requests answered with a 5xx: the availability SLI.",
                         "percentunit", [(q.ratio(REQ, ERRORS), "5xx ratio")], width=6),
        stat_panel("Requests in flight", "Requests the TokenizerManager holds right now (rid_to_state size).",
                   "short", [(q.gauge("sightline_requests_in_flight"), "in flight")], height=8, decimals=0),
        timeseries_panel("Token throughput",
                         "Prompt tokens and generated tokens of ended requests per second (as in `usage`).",
                         "suffix: tokens/s",
                         [(q.rate("sightline_prompt_tokens_total"), "prompt"),
                          (q.rate("sightline_generation_tokens_total"), "generation")]),
        timeseries_panel("Running, waiting, in flight",
                         "Requests in the running batch and in the Scheduler's waiting queue (from its stats "
                         "messages), and requests the TokenizerManager holds. In flight far above running + "
                         "waiting means requests are stuck between processes.", "short",
                         [(q.gauge("sightline_num_requests_running"), "running"),
                          (q.gauge("sightline_num_requests_waiting"), "waiting"),
                          (q.gauge("sightline_requests_in_flight"), "in flight")]),
    )
    b.row(
        "Latency",
        latency_panel("Time to first token",
                      "HTTP arrival → first output token in the TokenizerManager (tokenize, queue, prefill and "
                      "the hops included). p50 / p90 / p99 and mean.", "sightline_time_to_first_token_seconds"),
        latency_panel("Inter-token latency",
                      "Gap between consecutive output tokens of a request, pooled over all requests.",
                      "sightline_inter_token_latency_seconds"),
        latency_panel("Time per output token",
                      "Per request: (e2e − TTFT) / (output tokens − 1). One long stall shows in ITL, not here.",
                      "sightline_time_per_output_token_seconds"),
        latency_panel("End-to-end latency", "HTTP arrival → final output of the request.",
                      "sightline_e2e_request_latency_seconds"),
    )
    b.row(
        "Capacity",
        timeseries_panel("KV cache usage",
                         "Reserved KV slots ÷ total: admission headroom. Near 100 % new requests wait.",
                         "percentunit", [(q.gauge("sightline_kv_usage_ratio", agg="max"), "KV reserved")],
                         max_value=1),
        timeseries_panel("Engine throughput",
                         "Tokens the engine samples per second, as the Scheduler measures it.",
                         "suffix: tokens/s",
                         [(q.gauge("sightline_generation_throughput_tokens_per_second"), "generation")]),
    )
    return b
