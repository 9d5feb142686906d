"""loadtest/replay/export.py: recorded traffic as the spans GuideLLM's `otel` (and `trace_synthetic`)
data kinds read.  Inputs are real captures from one tiny-random server run
(tests/fixtures/otel/record.py): its flight-recorder dump (with content) and the OTLP export
requests it sent, in protobuf's own JSON and converted here to the Collector's encoding."""

from __future__ import annotations

import base64
import copy
import json
from datetime import datetime

import pytest

from loadtest.replay.export import (
    IN,
    OUT,
    STATUS_ERROR,
    conversation_order,
    export,
    from_otlp,
    from_records,
    main,
    otlp_id,
)
from telemetry.request_record import RequestRecord, read_records
from tests.helpers import FIXTURES as ALL_FIXTURES

FIXTURES = ALL_FIXTURES / "otel"
DUMP, OTLP = FIXTURES / "dump", FIXTURES / "otlp.jsonl"


def by_rid(rows: list[dict]) -> dict[str, dict]:
    return {r["attributes"]["gen_ai.response.id"]: r for r in rows}


def check_guidellm_shape(row: dict) -> None:
    """What GuideLLM 0.8's trace_otel.py and trace_common.py read from a span-per-line file."""
    assert len(row["trace_id"]) == 32 and int(row["trace_id"], 16) >= 0
    assert len(row["span_id"]) == 16 and int(row["span_id"], 16) >= 0
    assert datetime.fromisoformat(row["start_time"]).tzinfo is not None
    attrs = row["attributes"]
    assert isinstance(attrs, dict)
    assert attrs["gen_ai.operation.name"] in ("chat", "text_completion", "generate")
    assert isinstance(attrs[IN], int) and isinstance(attrs[OUT], int)
    assert row["status"]["code"] in (0, 1, 2)
    assert (row["input_length"], row["output_length"]) == (attrs[IN], attrs[OUT])
    assert row["timestamp"] == pytest.approx(datetime.fromisoformat(row["start_time"]).timestamp(), abs=1e-6)
    if "gen_ai.input.messages" in attrs:
        msgs = json.loads(attrs["gen_ai.input.messages"])
        assert msgs and all({"role", "content"} <= set(m) for m in msgs)


def collector_encoding(doc: dict) -> dict:
    """protobuf JSON (MessageToJson: base64 ids, enum names) → the Collector's file exporter's JSON
    (hex ids, enum numbers)."""
    doc = copy.deepcopy(doc)
    kinds = {
        "SPAN_KIND_INTERNAL": 1,
        "SPAN_KIND_SERVER": 2,
        "SPAN_KIND_CLIENT": 3,
        "SPAN_KIND_PRODUCER": 4,
        "SPAN_KIND_CONSUMER": 5,
    }
    codes = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if s.get(key):
                        s[key] = base64.b64decode(s[key]).hex()
                s["kind"] = kinds.get(s.get("kind"), 0)
                if "code" in s.get("status", {}):
                    s["status"]["code"] = codes[s["status"]["code"]]
    return doc


@pytest.fixture(scope="module")
def from_dump() -> list[dict]:
    rows, skipped = export(DUMP)
    assert dict(skipped) == {"refused before tokenizing (rejected)": 1}
    return rows


def test_dump_export_has_the_shape_guidellm_reads(from_dump):
    records = {r.rid: r for r in read_records(DUMP)}
    assert len(from_dump) == 5
    for row in from_dump:
        check_guidellm_shape(row)
        rec = records[row["attributes"]["gen_ai.response.id"]]
        assert row["attributes"]["gen_ai.operation.name"] == rec.operation
        assert (row["input_length"], row["output_length"]) == (rec.prompt_tokens, rec.completion_tokens)
        assert row["timestamp"] == pytest.approx(rec.arrival, abs=1e-6)
        assert row["duration"] == pytest.approx(rec.breakdown["e2e_ms"] / 1000, abs=1e-6)
        assert row["trace_id"] == rec.trace_id and row["status"]["code"] == 0
        if isinstance(rec.prompt, str):  # recorded with --dump-content
            assert json.loads(row["attributes"]["gen_ai.input.messages"]) == [{"role": "user", "content": rec.prompt}]
        elif isinstance(rec.prompt, list) and isinstance(rec.prompt[0], dict):
            assert json.loads(row["attributes"]["gen_ai.input.messages"]) == rec.prompt
        else:  # token ids: no messages
            assert "gen_ai.input.messages" not in row["attributes"]
        assert row["attributes"]["gen_ai.output.text"] == rec.output
    assert [r["timestamp"] for r in from_dump] == sorted(r["timestamp"] for r in from_dump)


def test_otlp_protobuf_json_gives_the_same_spans_as_the_dump(from_dump):
    rows, skipped = export(OTLP)
    assert dict(skipped) == {"no token counts (refused before tokenizing)": 1}  # the 400
    dump, otlp = by_rid(from_dump), by_rid(rows)
    assert set(otlp) == set(dump)
    for rid, row in otlp.items():
        check_guidellm_shape(row)
        d = dump[rid]
        assert (row["trace_id"], row["input_length"], row["output_length"]) == (
            d["trace_id"],
            d["input_length"],
            d["output_length"],
        )
        assert row["attributes"]["gen_ai.operation.name"] == d["attributes"]["gen_ai.operation.name"]
        assert row["timestamp"] == pytest.approx(d["timestamp"], abs=0.01)  # two clocks of one process
        assert row["duration"] == pytest.approx(d["duration"], abs=0.05)
        assert row["kind"] == "SERVER" and row["status"]["code"] == 0
        assert "gen_ai.input.messages" not in row["attributes"]  # our spans carry no content


def test_collector_encoding_and_a_single_pretty_document(tmp_path):
    docs = [json.loads(line) for line in OTLP.read_text().splitlines()]
    expected = by_rid(export(OTLP)[0])
    (tmp_path / "collector.jsonl").write_text("".join(json.dumps(collector_encoding(d)) + "\n" for d in docs))
    assert by_rid(export(tmp_path / "collector.jsonl")[0]) == expected
    merged = {"resourceSpans": [rs for d in docs for rs in d["resourceSpans"]]}
    (tmp_path / "one.json").write_text(json.dumps(merged, indent=2))
    assert by_rid(export(tmp_path / "one.json", "otlp")[0]) == expected


def test_token_counts_missing_on_the_server_span_come_from_its_children():
    docs = [json.loads(line) for line in OTLP.read_text().splitlines()]
    expected = by_rid(from_otlp(OTLP.read_text())[0])
    for d in docs:
        for rs in d["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    if s.get("kind") == "SPAN_KIND_SERVER":
                        s["attributes"] = [kv for kv in s["attributes"] if not kv["key"].startswith("gen_ai.usage.")]
    rows, skipped = from_otlp("\n".join(json.dumps(d) for d in docs))
    # tokenize/prefill spans have the input tokens; stream/decode spans (matched by sightline.rid) the output's
    got = by_rid(rows)
    assert set(got) == set(expected)
    for rid, r in expected.items():
        assert (got[rid]["input_length"], got[rid]["output_length"]) == (r["input_length"], r["output_length"])
        assert (got[rid]["attributes"][IN], got[rid]["attributes"][OUT]) == (r["attributes"][IN], r["attributes"][OUT])
    assert dict(skipped) == {"no token counts (refused before tokenizing)": 1}


def test_failed_requests_are_error_spans_and_only_ok_drops_them(tmp_path):
    base = dict(
        route="/v1/completions",
        operation="text_completion",
        model="m",
        prompt_tokens=10,
        completion_tokens=3,
        breakdown={"e2e_ms": 100.0},
    )
    records = [
        RequestRecord(arrival=1.0, rid="a", outcome="stop", finish_reason="stop", trace_id="1" * 32, **base),
        RequestRecord(arrival=2.0, rid="b", outcome="client_disconnect", finish_reason="abort", **base),
        RequestRecord(arrival=3.0, rid="c", outcome="length", finish_reason="length", trace_id="1" * 32, **base),
    ]
    rows, _ = from_records(records)
    assert [r["status"]["code"] for r in rows] == [0, STATUS_ERROR, 0]
    assert len(rows[1]["trace_id"]) == 32 and len(rows[1]["span_id"]) == 16
    # GuideLLM groups consecutive equal trace ids into one conversation: keep a trace's spans together
    assert [r["attributes"]["gen_ai.response.id"] for r in conversation_order(rows)] == ["a", "c", "b"]
    from telemetry.request_record import encode

    (tmp_path / "requests-x-1.jsonl").write_bytes(b"".join(encode(r) + b"\n" for r in records))
    out = tmp_path / "spans.jsonl"
    assert main([str(tmp_path), "-o", str(out), "--only-ok"]) == 0
    assert [json.loads(line)["attributes"]["gen_ai.response.id"] for line in out.read_text().splitlines()] == ["a", "c"]


def test_ids():
    assert otlp_id("AAECAwQFBgcICQoLDA0ODw==") == "000102030405060708090a0b0c0d0e0f"
    assert otlp_id("0102030405060708") == "0102030405060708"
    assert otlp_id("") is None and otlp_id(None) is None
