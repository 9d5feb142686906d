"""The OpenTelemetry GenAI instruments sightline records, and which version of the conventions it emits.

The GenAI conventions moved to open-telemetry/semantic-conventions-genai (semconv 1.42.0): token
usage is no longer the one histogram `gen_ai.client.token.usage` by `gen_ai.token.type` but
counters per token category by `gen_ai.token.modality` (`gen_ai.client.inference.usage.*`, for
totals and cost, recorded for every inference operation, failed ones included) beside per-operation
histograms (`gen_ai.client.inference.operation.*`, for percentiles).  The model-server instruments
(`gen_ai.server.*`) are unchanged.

Which names are emitted (`--otel-genai-semconv`, else $OTEL_SEMCONV_STABILITY_OPT_IN):
`legacy` (the default: the names emitted before, as the conventions ask of existing
instrumentations), `latest` (only the new; what `gen_ai_latest_experimental` in the variable asks
for) or `both` (old and new side by side while dashboards move over, until the old are dropped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from opentelemetry.semconv.schemas import Schemas

SCHEMA_URL = Schemas.V1_42_0.value  # on the meter, the tracer and kept traces' scope: the names' version
SEMCONV_MODES = ("legacy", "latest", "both")
OPT_IN_LATEST = "gen_ai_latest_experimental"  # the conventions' OTEL_SEMCONV_STABILITY_OPT_IN value
LEGACY, LATEST = "legacy", "latest"


@dataclass(frozen=True)
class Instrument:
    name: str
    unit: str
    description: str
    buckets: tuple[float, ...]  # () for a counter
    prometheus: str  # our closest Prometheus metric (docs/metrics.md)
    recorded: str  # when a request is recorded (docs/metrics.md)
    kind: str = "histogram"  # histogram | counter
    semconv: str = "both"  # the modes it is emitted in: both (always) | legacy | latest

    def emitted(self, mode: str) -> bool:
        return self.semconv == "both" or mode == "both" or self.semconv == mode


TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))
TTFT = Instrument(
    "gen_ai.server.time_to_first_token",
    "s",
    "Time to generate first token for successful responses.",
    (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    "sightline_time_to_first_token_seconds",
    "successful requests that produced a token",
)
TPOT = Instrument(
    "gen_ai.server.time_per_output_token",
    "s",
    "Time per output token generated after the first token for successful responses.",
    (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
    "sightline_time_per_output_token_seconds",
    "successful requests of n >= 2 output tokens: (e2e − TTFT) / (n − 1)",
)
DURATION = Instrument(
    "gen_ai.server.request.duration",
    "s",
    "Generative AI server request duration such as time-to-last byte or last output token.",
    (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92),
    "sightline_e2e_request_latency_seconds",
    "every request: finished, failed or aborted (`error.type`), or refused before the engine (`error.type`)",
)
TOKENS = Instrument(
    "gen_ai.client.token.usage",
    "{token}",
    "Number of input and output tokens used.",
    TOKEN_BUCKETS,
    "sightline_request_prompt_tokens / sightline_request_generation_tokens",
    "successful requests, twice: `gen_ai.token.type` input (prompt tokens) and output (completion tokens), "
    "as in the response's `usage` (legacy names)",
    semconv=LEGACY,
)
_EVERY = (
    "every request, failed and refused ones too, `gen_ai.token.modality` text (`unknown` with 0 for a "
    "request refused before it was tokenized)"
)
USAGE_INPUT = Instrument(
    "gen_ai.client.inference.usage.input_tokens",
    "{token}",
    "The number of input (prompt) tokens used, including cached tokens.",
    (),
    "sightline_prompt_tokens_total",
    _EVERY + ": its prompt tokens (latest names)",
    "counter",
    LATEST,
)
USAGE_OUTPUT = Instrument(
    "gen_ai.client.inference.usage.output_tokens",
    "{token}",
    "The number of output (completion) tokens used, including reasoning tokens.",
    (),
    "sightline_generation_tokens_total",
    _EVERY + ": its completion tokens (latest names)",
    "counter",
    LATEST,
)
USAGE_CACHE_READ = Instrument(
    "gen_ai.client.inference.usage.cache_read.input_tokens",
    "{token}",
    "The number of input tokens read from the cache (a subset of the input tokens).",
    (),
    "sightline_tenant_cached_tokens_total",
    _EVERY + ": its prompt tokens reused from the prefix cache "
    "(`usage.prompt_tokens_details.cached_tokens`; latest names)",
    "counter",
    LATEST,
)
OPERATION_INPUT = Instrument(
    "gen_ai.client.inference.operation.input_tokens",
    "{token}",
    "The number of input (prompt) tokens used per inference operation.",
    TOKEN_BUCKETS,
    "sightline_request_prompt_tokens",
    "successful requests: the prompt tokens (latest names)",
    semconv=LATEST,
)
OPERATION_OUTPUT = Instrument(
    "gen_ai.client.inference.operation.output_tokens",
    "{token}",
    "The number of output (completion) tokens used per inference operation.",
    TOKEN_BUCKETS,
    "sightline_request_generation_tokens",
    "successful requests: the completion tokens (latest names)",
    semconv=LATEST,
)
INSTRUMENTS = (
    TTFT,
    TPOT,
    DURATION,
    TOKENS,
    USAGE_INPUT,
    USAGE_OUTPUT,
    USAGE_CACHE_READ,
    OPERATION_INPUT,
    OPERATION_OUTPUT,
)


def resolve_semconv(flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """The names to emit: the flag, else `latest` when $OTEL_SEMCONV_STABILITY_OPT_IN lists
    gen_ai_latest_experimental, else `legacy`."""
    if flag:
        if flag not in SEMCONV_MODES:
            raise ValueError(f"unknown GenAI semconv mode {flag!r}: use {', '.join(SEMCONV_MODES)}")
        return flag
    raw = (os.environ if env is None else env).get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    opt_in = {v.strip() for v in raw.split(",")}
    return LATEST if OPT_IN_LATEST in opt_in else LEGACY
