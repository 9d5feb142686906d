"""One outcome per request: how every request that reached a generation route ended.

Exactly one of `OUTCOMES` is counted for each such request, as the `outcome` label of
`sightline_requests_total`, so that `sum by (outcome)` adds up to the requests received
(the finish reason and HTTP status labels beside it say the same thing at a finer or a
coarser grain; nothing else counts requests). The two functions below are the whole
mapping; docs/metrics.md lists the values.
"""

from __future__ import annotations

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

OUTCOMES = (STOP, LENGTH, REJECTED, SHED, UNAVAILABLE, CLIENT_DISCONNECT, TIMEOUT, ERROR, ENGINE_FAILURE, SHUTDOWN,
            ABORTED_BY_OPERATOR)
# abort reasons (the TokenizerManager's and the Scheduler's) that name an outcome of their own
_ABORTS = {CLIENT_DISCONNECT: CLIENT_DISCONNECT, "timeout": TIMEOUT, "shutdown": SHUTDOWN,
           "engine_failure": ENGINE_FAILURE, "operator": ABORTED_BY_OPERATOR}


def finished_outcome(finish_reason: str, abort_reason: str | None) -> str:
    """A request the TokenizerManager admitted and then finished."""
    if finish_reason in (STOP, LENGTH):
        return finish_reason
    if finish_reason == "abort":
        return _ABORTS.get(abort_reason or "", ERROR)
    return ERROR


def refused_outcome(status: int, code: str | None) -> str:
    """A request that ended before admission, by its HTTP status (and error code for 503s)."""
    if status == 429:
        return SHED
    if status == 499:
        return CLIENT_DISCONNECT
    if status == 503:
        return SHUTDOWN if code == "shutting_down" else UNAVAILABLE
    if 400 <= status < 500:
        return REJECTED
    return ERROR
