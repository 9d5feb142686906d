"""How a request ends, in one table: finish reason, abort reason, HTTP status, outcome.

Exactly one of `OUTCOMES` is counted for each request that reached a generation route,
as the `outcome` label of `sightline_requests_total`, so that `sum by (outcome)` adds up
to the requests received (the finish reason and HTTP status labels beside it say the
same thing at a finer or a coarser grain; nothing else counts requests).

`ENDINGS` is the only place these are related: the front end's status and API error
type (serving.frontend.errors), the `outcome` label (the functions below) and the series
of `sightline_requests_total` and `sightline_request_aborts_total` that exist at 0 before
any traffic (telemetry.metrics) are all read from it. A new abort reason is one row of
`ABORTS`; docs/metrics.md lists the values.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.reasons import ENGINE_ERROR, AbortReason, FinishReason

FINISH_REASONS = tuple(r.value for r in FinishReason)
# the API's, never the engine's: a request the model stopped whose answer the front end parsed as tool calls
TOOL_CALLS = "tool_calls"
REQUEST_FINISH_REASONS = FINISH_REASONS + (TOOL_CALLS,)  # the `finish_reason` label of sightline_requests_total

STOP, LENGTH = "stop", "length"  # the model finished: a stop token or string; max_tokens or the context
REJECTED = "rejected"  # a 4xx before admission: bad body, too large, body not in time...
SHED = "shed"  # 429: the server was full (--max-queued-requests, --max-inflight-tokens)
UNAVAILABLE = "unavailable"  # 503 before admission: the engine was starting, restarting or stalled
CLIENT_DISCONNECT = "client_disconnect"  # the client left (before or during generation)
TIMEOUT = "timeout"  # the request's deadline passed (--request-timeout, x-request-timeout)
ERROR = "error"  # the engine or the server failed this request alone
ENGINE_FAILURE = "engine_failure"  # in flight when an engine process died or stalled
SHUTDOWN = "shutdown"  # in flight (or arriving) while the server shut down
ABORTED_BY_OPERATOR = "aborted_by_operator"  # ended by an operator's control action

OUTCOMES = (
    STOP,
    LENGTH,
    REJECTED,
    SHED,
    UNAVAILABLE,
    CLIENT_DISCONNECT,
    TIMEOUT,
    ERROR,
    ENGINE_FAILURE,
    SHUTDOWN,
    ABORTED_BY_OPERATOR,
)

SHUTTING_DOWN = "shutting_down"  # the error code of a 503 refused because the server is shutting down


@dataclass(frozen=True)
class Ending:
    """One way a request ends: the labels it is counted with, and what a client still there is told."""

    finish_reason: str
    status: int  # the HTTP status it ends with (its `status` label)
    outcome: str
    abort_reason: str | None = None  # finish_reason "abort": the reason the TokenizerManager or Scheduler gave
    code: str | None = None  # a refusal: the error code that picks this row over another of its status
    error_type: str | None = None  # the API error `type` of an admitted request that ends without its answer


# an admitted request the model finished, or the engine failed alone; a stop whose answer is tool calls is
# a finer grain of stop (its outcome), so `sum by (outcome)` is unchanged by tool calling
FINISHED = (
    Ending("stop", 200, STOP),
    Ending(TOOL_CALLS, 200, STOP),
    Ending("length", 200, LENGTH),
    Ending("error", 500, ERROR, error_type="internal_error"),
)
# an admitted request aborted, by its abort reason (client_disconnect also: a client gone before its body was read)
ABORTS = (
    Ending("abort", 499, CLIENT_DISCONNECT, AbortReason.CLIENT_DISCONNECT),
    Ending("abort", 503, SHUTDOWN, AbortReason.SHUTDOWN, error_type="server_unavailable"),
    Ending("abort", 504, TIMEOUT, AbortReason.TIMEOUT, error_type="timeout"),
    Ending("abort", 503, ENGINE_FAILURE, AbortReason.ENGINE_FAILURE, error_type="server_unavailable"),
    Ending("abort", 500, ERROR, AbortReason.INTERNAL_ERROR, error_type="internal_error"),
    Ending("abort", 503, ABORTED_BY_OPERATOR, AbortReason.OPERATOR, error_type="server_unavailable"),
)
# a request refused before admission, by its status (any other 4xx is rejected too, any other 5xx an error)
REFUSALS = (
    Ending("error", 400, REJECTED),
    Ending("error", 408, REJECTED),
    Ending("error", 413, REJECTED),
    Ending("error", 429, SHED),
    Ending("error", 503, UNAVAILABLE),
    Ending("error", 503, SHUTDOWN, code=SHUTTING_DOWN),
)
ENDINGS = FINISHED + ABORTS + REFUSALS

ABORT_REASONS = tuple(e.abort_reason for e in ABORTS if e.abort_reason)
ABORT_STATUS = {e.abort_reason: e.status for e in ABORTS}
CLIENT_GONE = ABORT_STATUS[AbortReason.CLIENT_DISCONNECT]  # the status of a request whose client left
ERROR_TYPES = {e.status: e.error_type for e in ENDINGS if e.error_type}  # by status: one type each
_BY_ABORT = {e.abort_reason: e for e in ABORTS}
_BY_FINISH = {e.finish_reason: e for e in FINISHED}
_BY_REFUSAL = {(e.status, e.code): e for e in REFUSALS}


def ending_for(error_type: str | None) -> Ending:
    """How a request the engine ended with a cause the client must hear is answered: an abort reason (a
    timeout in the queue) stays that abort, anything else (`ENGINE_ERROR`) finishes it with `error`."""
    return _BY_ABORT.get(error_type or "") or _BY_FINISH[FinishReason.ERROR]


def error_type_of(finish_reason: str, abort_reason: str | None) -> str | None:
    """The error type a span and a request record carry: the abort reason, or `ENGINE_ERROR` for a request
    the engine failed without one."""
    return (abort_reason or ENGINE_ERROR) if finish_reason == FinishReason.ERROR else abort_reason


def requests_series() -> tuple[dict[str, str], ...]:
    """The (finish_reason, status, outcome) label sets of `sightline_requests_total`, one per distinct ending."""
    seen = dict.fromkeys((e.finish_reason, str(e.status), e.outcome) for e in ENDINGS)
    return tuple({"finish_reason": f, "status": s, "outcome": o} for f, s, o in seen)


def http_status(finish_reason: str, abort_reason: str | None) -> int:
    """The status a request that reached the engine ends with (also its `status` label)."""
    row = _BY_ABORT.get(abort_reason or "") or _BY_FINISH.get(finish_reason)
    return row.status if row is not None else 200


def finished_outcome(finish_reason: str, abort_reason: str | None) -> str:
    """A request the TokenizerManager admitted and then finished."""
    row = _BY_ABORT.get(abort_reason or "") if finish_reason == FinishReason.ABORT else _BY_FINISH.get(finish_reason)
    return row.outcome if row is not None else ERROR


def refused_outcome(status: int, code: str | None) -> str:
    """A request that ended before admission, by its HTTP status (and error code for 503s)."""
    row = _BY_REFUSAL.get((status, code)) or _BY_REFUSAL.get((status, None))
    if row is not None:
        return row.outcome
    if status == CLIENT_GONE:
        return CLIENT_DISCONNECT
    return REJECTED if 400 <= status < 500 else ERROR
