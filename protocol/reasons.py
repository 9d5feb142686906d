"""Why a request ends, as every process says it on the wire: the engine's `FinishReason` and the
`AbortReason` an `AbortReq` (or a `StrOut`, or a late message's stale-drop label) carries.

They are `StrEnum`s, so a member is its value wherever a plain string is expected (msgpack, metric
labels, dict keys).  How each ending is counted and answered (status, outcome, API error type) is
`telemetry.outcomes.ENDINGS`, which is built from these.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Why a request stopped generating (the `finish_reason` the engine, the API and the metrics use)."""

    STOP = "stop"  # EOS or a stop token id (stop strings are the Detokenizer's)
    LENGTH = "length"  # max_new_tokens or the context window
    ABORT = "abort"
    ERROR = "error"  # the engine failed on this request alone (its batch mates carry on)


class AbortReason(enum.StrEnum):
    """Why a request was aborted: the client-facing ones are rows of `telemetry.outcomes.ABORTS`; the last
    three end a request inside the engine's processes and never reach a client as an abort."""

    CLIENT_DISCONNECT = "client_disconnect"  # the client left (before or during generation)
    SHUTDOWN = "shutdown"  # in flight while the server shut down
    TIMEOUT = "timeout"  # its deadline passed (--request-timeout, x-request-timeout, --max-queue-time)
    ENGINE_FAILURE = "engine_failure"  # in flight when an engine process died or stalled
    INTERNAL_ERROR = "internal_error"  # the front end failed while handling its output
    OPERATOR = "operator"  # an operator's pause in mode abort
    STOP_STRING = "stop_string"  # the Detokenizer matched a stop string: a normal finish in the Scheduler
    DETOKENIZER_ERROR = "detokenizer_error"  # the Detokenizer could not decode its output
    WORKER_GONE = "worker_gone"  # its tokenizer worker died: no one is left to answer


ENGINE_ERROR = "engine_error"  # the error type of a request the engine failed alone (finish_reason error)
