"""What telemetry keeps of one request in the main process, in one object the request's state owns
(`ReqState.trace`): its server span and trace ids, the receive stamps its latencies are measured from,
its decode-gap events, its outcome, and the flight recorder's input and output digest.

Only telemetry reads and writes it (`telemetry.request_telemetry` and the helpers it calls); the
request's control flow (admission, outputs, its finish) never looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span


@dataclass
class RequestTrace:
    # -- tracing --
    span: Span | None = None
    ctx: Context | None = None
    trace_id: str | None = None  # of a sampled trace (head-sampled, or kept by tail sampling at the end)
    tail_id: str | None = None  # of a trace recorded for tail sampling, until its end decides
    choice_of: str | None = None  # one choice of a request with several (`n`, prompts): that request decides
    ended: bool = False  # the server span is closed
    # -- what its latencies are measured from --
    first_recv: int | None = None  # monotonic ns: first output token received
    last_recv: int | None = None
    tokenize_ns: int = 0
    detok_busy_ns: int = 0
    gap_events: int = 0  # decode_gap events put on its span (telemetry.downstream_gaps)
    outcome: str | None = None  # telemetry.outcomes' name for how it ended
    # -- flight recorder (--dump-requests / --crash-dump-dir; None when it is off) --
    dump_input: Any = None  # the request as built (the front end's GenerateReqInput): prompt or messages, sampling
    dump_output: Any = None  # telemetry.flight_recorder.OutputDigest: the output's length, SHA-256 (text)

    def exemplar(self) -> dict[str, str] | None:
        """The exemplar its observations carry: its trace, when kept."""
        return {"trace_id": self.trace_id} if self.trace_id else None
