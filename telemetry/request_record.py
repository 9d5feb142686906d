"""One finished request as the flight recorder writes it (`--dump-requests DIR`): the record
format shared by the writer (`telemetry.flight_recorder`), crash dumps and replay
(`loadtest.replay`) and the OpenTelemetry export for replay tools.

Files are JSON lines, `requests-<UTC time>-<n>.jsonl`, one `RequestRecord` per line,
oldest first within a file and across files in name order.  Without `--dump-content` the
texts are replaced by their length and SHA-256 (a replay then sends synthetic text of the
recorded token length).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import msgspec

FORMAT_VERSION = 1
FILE_GLOB = "requests-*.jsonl"


class RequestRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = FORMAT_VERSION
    arrival: float  # wall clock, s since the epoch: the HTTP handler was entered
    rid: str
    route: str  # the path it came in on: /v1/chat/completions | /v1/completions | /generate | /v1/embeddings | ...
    operation: str  # gen_ai.operation.name: text_completion | chat | generate | embeddings (rerank, score too)
    model: str
    stream: bool = False
    tenant: str = "default"  # the tenant its API key named
    user: str | None = None  # the client's OpenAI `user` field
    params: dict = {}  # sampling parameters as the engine ran them (max_new_tokens, temperature, top_p, ...)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0  # times the engine took it out of the batch (KV ran out) and resumed it
    outcome: str  # telemetry.outcomes: stop | length | rejected | shed | ... (one per request)
    finish_reason: str | None = None
    status: int = 200
    breakdown: dict = {}  # ttft_ms, queue_ms (every wait in the queue), wait_ms (queue_ms by reason), prefill_ms,
    # decode_ms, tokenize_ms, detokenize_ms, e2e_ms, tpot_ms
    trace_id: str | None = None  # the exported trace (head-sampled or kept by tail sampling)
    prompt_chars: int = 0
    prompt_sha256: str = ""
    output_chars: int = 0
    output_sha256: str = ""
    prompt: str | list | None = None  # only with --dump-content: the text, or the chat messages
    output: str | None = None  # only with --dump-content
    tool_call_parse_failed: str | None = None  # the tool-call parser that could not read the answer's calls
    tool_call_text: str | None = None  # only with --dump-content: the text it could not read


_decoder = msgspec.json.Decoder(RequestRecord)
encode = msgspec.json.Encoder().encode


def read_records(path: str | Path) -> Iterator[RequestRecord]:
    """Every record of a dump directory (or one .jsonl file), in the order written; a torn last
    line (the writer was killed mid-write) is skipped."""
    path = Path(path)
    files = sorted(path.glob(FILE_GLOB)) if path.is_dir() else [path]
    for f in files:
        with f.open("rb") as fh:
            for line in fh:
                if line.strip():
                    try:
                        yield _decoder.decode(line)
                    except msgspec.DecodeError:
                        continue
