"""Export recorded traffic as the OpenTelemetry spans GuideLLM replays (`--data kind=otel`).

    python -m loadtest.replay.export DUMP_DIR -o spans.jsonl            # a --dump-requests directory
    python -m loadtest.replay.export traces.json -o spans.jsonl         # the Collector's `file` exporter

GuideLLM (0.8, `guidellm/data/deserializers/trace_otel.py`) reads JSON lines, one span per
line, each a flat dict: `trace_id`, `span_id`, `parent_span_id`, `start_time` (ISO 8601;
naive times are taken as UTC) and `attributes`, a plain mapping that must hold
`gen_ai.operation.name` (chat | text_completion | generate) and `gen_ai.usage.input_tokens` /
`gen_ai.usage.output_tokens`; `status.code` 2 (ERROR) drops the span.  Spans are grouped into
conversations by consecutive equal `trace_id`, and each conversation's turns are replayed
from its own start.  `kind=otel` sends each span's `gen_ai.input.messages` (a JSON list of
chat messages): a span without them is refused ("use kind=trace_synthetic for
token-count-only traces").  So every line written here also carries the top-level columns
GuideLLM's `trace_synthetic` kind reads — `timestamp` (epoch seconds), `input_length`,
`output_length` — and `duration` (seconds, the recorded e2e: GuideLLM's idle-gap pacing):
the same file replays with synthetic prompts of the recorded lengths on one shared
timeline, which is what a dump without `--dump-content` (or spans without message content,
like ours) needs.

Inputs:
- a dump directory (or one `requests-*.jsonl`) of `telemetry.request_record.RequestRecord`s:
  one span per request that reached the tokenizer (`prompt_tokens` > 0); `trace_id` is the
  exported trace's, or one derived from the request id; with `--dump-content`, the prompt
  becomes `gen_ai.input.messages` (a text prompt as one user message; token-id prompts have
  none) and the output `gen_ai.output.text`.
- an OTLP JSON file as the OpenTelemetry Collector's `file` exporter writes it (JSON lines of
  ExportTraceServiceRequest in protobuf JSON; a single pretty-printed document works too):
  the `SERVER` spans that carry `gen_ai.operation.name` (our HTTP server span, from the
  process whose `sightline.process.role` is `main`, or a tokenizer worker), times from
  `startTimeUnixNano`/`endTimeUnixNano`, attributes from their key/value lists, ids in hex
  (base64, as protobuf's own JSON writes bytes, is decoded).  A token count the server span
  lacks is taken from the other spans of its request (same trace and `sightline.rid`, or its
  children): `tokenize` and the Scheduler's `prefill` have the input tokens, `stream` and
  `decode` the output tokens.

Requests that did not end with stop/length are exported with `status.code` 2 (GuideLLM's
`otel` kind skips them; `trace_synthetic` does not look at status); `--only-ok` leaves them
out.  GuideLLM 0.8's `otel` kind stops loading at the first span without
`gen_ai.input.messages` (InvalidRowError): `--only-with-messages` leaves those out (a
token-id prompt has no messages even with `--dump-content`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from telemetry.request_record import RequestRecord, read_records

STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
SUCCESS = ("stop", "length")
# the attributes kept from an OTLP server span (plain values of one type each, so that the JSON
# lines load as one table): the GenAI ones and a few of HTTP's and ours
KEEP_PREFIXES = (
    "gen_ai.",
    "http.",
    "error.type",
    "sightline.rid",
    "sightline.ttft_seconds",
    "sightline.queue_seconds",
    "sightline.outcome",
)
IN, OUT = "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"
_HEX = re.compile(r"[0-9a-fA-F]+")


def iso(t_s: float) -> str:
    """Epoch seconds → ISO 8601 in UTC with microseconds and an explicit offset."""
    return datetime.fromtimestamp(t_s, tz=timezone.utc).isoformat(timespec="microseconds")


def derived_id(text: str, hex_chars: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:hex_chars]


def span_row(
    *,
    trace_id: str,
    span_id: str,
    parent_span_id: str | None,
    name: str,
    start_s: float,
    end_s: float | None,
    status: int,
    attributes: dict,
) -> dict:
    """One line of the export: GuideLLM's OTEL span plus its `trace_synthetic` columns."""
    row = {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_span_id": parent_span_id,
        "name": name,
        "kind": "SERVER",
        "start_time": iso(start_s),
        "end_time": iso(end_s) if end_s is not None else None,
        "status": {"code": status},
        "attributes": attributes,
        "timestamp": round(start_s, 6),
        "input_length": int(attributes[IN]),
        "output_length": int(attributes[OUT]),
    }
    if end_s is not None:
        row["duration"] = round(max(0.0, end_s - start_s), 6)
    return row


# -- from a dump ----------------------------------------------------------------------------------
def messages_of(rec: RequestRecord) -> list | None:
    """The recorded prompt as chat messages (a text prompt: one user message); None without content
    or for a token-id prompt."""
    p = rec.prompt
    if isinstance(p, str):
        return [{"role": "user", "content": p}]
    if isinstance(p, list) and p and all(isinstance(m, dict) for m in p):
        return p
    return None


def from_records(records: Iterable[RequestRecord]) -> tuple[list[dict], Counter]:
    rows, skipped = [], Counter()
    for rec in records:
        if rec.prompt_tokens <= 0:
            skipped[f"refused before tokenizing ({rec.outcome})"] += 1
            continue
        e2e = (rec.breakdown or {}).get("e2e_ms")
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": rec.operation,
            "gen_ai.request.model": rec.model,
            IN: rec.prompt_tokens,
            OUT: rec.completion_tokens,
            "gen_ai.response.id": rec.rid,
            "gen_ai.response.finish_reasons": [rec.finish_reason] if rec.finish_reason else [],
            "gen_ai.usage.cache_read.input_tokens": rec.cached_tokens,
            "http.route": rec.route,
            "http.response.status_code": rec.status,
            "sightline.outcome": rec.outcome,
        }
        if (ttft := (rec.breakdown or {}).get("ttft_ms")) is not None:
            attrs["sightline.ttft_seconds"] = ttft / 1000.0
        if (msgs := messages_of(rec)) is not None:
            attrs["gen_ai.input.messages"] = json.dumps(msgs, ensure_ascii=False)
        if rec.output is not None:
            attrs["gen_ai.output.text"] = rec.output
        rows.append(
            span_row(
                trace_id=rec.trace_id or derived_id(f"trace:{rec.rid}", 32),
                span_id=derived_id(f"span:{rec.rid}", 16),
                parent_span_id=None,
                name=f"POST {rec.route}",
                start_s=rec.arrival,
                end_s=rec.arrival + e2e / 1000.0 if e2e is not None else None,
                status=STATUS_UNSET if rec.outcome in SUCCESS else STATUS_ERROR,
                attributes=attrs,
            )
        )
    return rows, skipped


# -- from OTLP JSON --------------------------------------------------------------------------------
def otlp_value(v: dict) -> Any:
    """An OTLP AnyValue in protobuf JSON → a plain value (int64 comes as a string)."""
    if not isinstance(v, dict) or not v:
        return None
    ((kind, x),) = v.items()
    if kind == "intValue":
        return int(x)
    if kind == "doubleValue":
        return float(x)
    if kind == "arrayValue":
        return [otlp_value(e) for e in (x or {}).get("values", [])]
    if kind == "kvlistValue":
        return otlp_attributes((x or {}).get("values", []))
    return x  # stringValue, boolValue, bytesValue (base64)


def otlp_attributes(kvs: list | None) -> dict:
    return {kv["key"]: otlp_value(kv.get("value") or {}) for kv in kvs or ()}


def otlp_id(value: str | None) -> str | None:
    """Hex, as the OTLP/JSON spec and the Collector write ids; base64 (protobuf's JSON for bytes) decoded."""
    if not value:
        return None
    if len(value) in (16, 32) and _HEX.fullmatch(value):
        return value.lower()
    return base64.b64decode(value).hex() or None


def otlp_enum(value: Any, names: dict[int, str], prefix: str) -> int:
    """An enum as an integer (OTLP/JSON) or by name (protobuf's JSON: SPAN_KIND_SERVER)."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.isdigit():
            return int(value)
        return {f"{prefix}{n}": k for k, n in names.items()}.get(value, 0)
    return 0


def otlp_documents(text: str) -> Iterator[dict]:
    """One ExportTraceServiceRequest per line, or one document for the whole file."""
    try:
        yield json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def otlp_spans(text: str) -> Iterator[dict]:
    """Every span of the file as {trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns,
    status, attributes, resource}."""
    for doc in otlp_documents(text):
        for rs in doc.get("resourceSpans") or doc.get("resource_spans") or ():
            resource = otlp_attributes((rs.get("resource") or {}).get("attributes"))
            for ss in rs.get("scopeSpans") or rs.get("scope_spans") or rs.get("instrumentationLibrarySpans") or ():
                for s in ss.get("spans") or ():
                    yield {
                        "trace_id": otlp_id(s.get("traceId")),
                        "span_id": otlp_id(s.get("spanId")),
                        "parent_span_id": otlp_id(s.get("parentSpanId")),
                        "name": s.get("name", ""),
                        "kind": KINDS.get(otlp_enum(s.get("kind"), KINDS, "SPAN_KIND_"), "UNSPECIFIED"),
                        "start_ns": int(s.get("startTimeUnixNano") or 0),
                        "end_ns": int(s.get("endTimeUnixNano") or 0),
                        "status": otlp_enum(
                            (s.get("status") or {}).get("code"), {0: "UNSET", 1: "OK", 2: "ERROR"}, "STATUS_CODE_"
                        ),
                        "attributes": otlp_attributes(s.get("attributes")),
                        "resource": resource,
                    }


def _is_request_span(s: dict) -> bool:
    role = str(s["resource"].get("sightline.process.role", "main"))
    return (
        s["kind"] == "SERVER"
        and "gen_ai.operation.name" in s["attributes"]
        and (role == "main" or role.startswith("worker"))
    )


def from_otlp(text: str) -> tuple[list[dict], Counter]:
    spans = list(otlp_spans(text))
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    rows, skipped = [], Counter()
    for s in spans:
        if not _is_request_span(s):
            continue
        attrs = {k: v for k, v in s["attributes"].items() if k.startswith(KEEP_PREFIXES)}
        rid = attrs.get("sightline.rid")
        for child in by_trace.get(s["trace_id"], ()):  # token counts the server span lacks, from its children
            if child is s or not (
                child["parent_span_id"] == s["span_id"] or (rid and child["attributes"].get("sightline.rid") == rid)
            ):
                continue
            for key in (IN, OUT):
                if attrs.get(key) is None and child["attributes"].get(key) is not None:
                    attrs[key] = child["attributes"][key]
        if attrs.get(IN) is None or attrs.get(OUT) is None:
            skipped["no token counts (refused before tokenizing)"] += 1
            continue
        rows.append(
            span_row(
                trace_id=s["trace_id"],
                span_id=s["span_id"],
                parent_span_id=s["parent_span_id"],
                name=s["name"],
                start_s=s["start_ns"] / 1e9,
                end_s=s["end_ns"] / 1e9 if s["end_ns"] else None,
                status=STATUS_ERROR if s["status"] == STATUS_ERROR else STATUS_UNSET,
                attributes=attrs,
            )
        )
    return rows, skipped


# -- the file ---------------------------------------------------------------------------------------
def conversation_order(rows: list[dict]) -> list[dict]:
    """Spans of one trace together (GuideLLM groups consecutive equal trace_ids), traces by their
    first start, spans by start within a trace."""
    groups: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["timestamp"]):
        groups.setdefault(r["trace_id"], []).append(r)
    return [r for g in groups.values() for r in g]


def detect(path: Path) -> str:
    if path.is_dir():
        return "dump"
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return "otlp" if b"resourceSpans" in head or b"resource_spans" in head else "dump"


def export(
    src: Path, kind: str = "auto", only_ok: bool = False, only_messages: bool = False
) -> tuple[list[dict], Counter]:
    kind = detect(src) if kind == "auto" else kind
    rows, skipped = from_records(read_records(src)) if kind == "dump" else from_otlp(src.read_text())
    for flag, reason, keep in (
        (only_ok, "not stop/length (--only-ok)", lambda r: r["status"]["code"] != STATUS_ERROR),
        (
            only_messages,
            "no gen_ai.input.messages (--only-with-messages)",
            lambda r: "gen_ai.input.messages" in r["attributes"],
        ),
    ):
        if flag:
            kept = [r for r in rows if keep(r)]
            if len(kept) < len(rows):
                skipped[reason] += len(rows) - len(kept)
            rows = kept
    return conversation_order(rows), skipped


def write(rows: list[dict], out: Path) -> None:
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.replay.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("source", type=Path, help="a --dump-requests directory or file, or an OTLP JSON file")
    ap.add_argument(
        "-o",
        "--out",
        type=Path,
        default=Path("guidellm_spans.jsonl"),
        help="the JSON lines file to write [guidellm_spans.jsonl]",
    )
    ap.add_argument(
        "--from",
        dest="kind",
        choices=("auto", "dump", "otlp"),
        default="auto",
        help="what the source is [auto: a directory or request records → dump; resourceSpans → otlp]",
    )
    ap.add_argument("--only-ok", action="store_true", help="leave out requests that did not end with stop/length")
    ap.add_argument(
        "--only-with-messages",
        action="store_true",
        help="leave out spans without gen_ai.input.messages (token-id prompts, dumps without content): "
        "GuideLLM's kind=otel stops at the first one",
    )
    a = ap.parse_args(argv)
    if not a.source.exists():
        print(f"error: {a.source} does not exist", file=sys.stderr)
        return 2
    try:
        rows, skipped = export(a.source, a.kind, a.only_ok, a.only_with_messages)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot read {a.source}: {exc}", file=sys.stderr)
        return 2
    write(rows, a.out)
    with_messages = sum("gen_ai.input.messages" in r["attributes"] for r in rows)
    print(
        f"wrote {len(rows)} spans ({len({r['trace_id'] for r in rows})} traces, {with_messages} with "
        f"gen_ai.input.messages) to {a.out}" + (f"; skipped {dict(skipped)}" if skipped else "")
    )
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
