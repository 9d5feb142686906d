"""The flight recorder and crash dumps on one real server (--dump-requests): every request sent is
one record with the outcome its client saw and no text; a dump directory that stops being
writable costs records (counted), never requests; kill -9 of the Scheduler leaves a complete
crash dump (the stopped-process stack path is unit-tested in tests/unit/test_flight_recorder.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from telemetry.request_record import read_records
from tests.server_util import HOLD, ServerProc, scrape, value, wait_until

SECRET = "flight recorder secret prompt"


def _one(url: str, i: int) -> tuple[int, str | None, str]:
    """Request i of a mix: (status, x-request-id, the outcome the client saw)."""
    if i == 0:  # a bad parameter: refused
        r = httpx.post(url + "/v1/completions", json={"prompt": SECRET, "max_tokens": 4, "temperature": -1}, timeout=60)
        return r.status_code, None, "rejected"
    if i == 1:  # streamed to the end
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={"prompt": SECRET, "max_tokens": 6, "ignore_eos": True, "stream": True},
        ) as r:
            body = b"".join(r.iter_bytes())
        assert b"[DONE]" in body
        return r.status_code, r.headers["x-request-id"], "length"
    if i == 2:  # the client goes away mid-stream (held one token short of its end: it cannot finish first)
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={"prompt": SECRET, "max_tokens": 8, "stream": True, **HOLD},
        ) as r:
            next(r.iter_lines())
            return r.status_code, r.headers["x-request-id"], "client_disconnect"
    if i % 3 == 0:
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": f"{SECRET} {i}"}], "max_tokens": 4, "ignore_eos": True},
        )
    elif i % 3 == 1:
        r = httpx.post(
            url + "/generate",
            timeout=60,
            json={"text": f"{SECRET} {i}", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        )
    else:
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": f"{SECRET} {i}", "max_tokens": 5, "ignore_eos": True, "seed": i},
            timeout=60,
        )
    return r.status_code, r.headers.get("x-request-id"), "length"


def test_every_request_is_recorded_and_a_crash_is_dumped(tmp_path):
    dump = tmp_path / "dump"
    srv = ServerProc("--dump-requests", str(dump), tmpdir=tmp_path)
    try:
        # (1) a mixed concurrent load: one record per request, outcomes as the clients saw them
        with ThreadPoolExecutor(8) as pool:
            sent = list(pool.map(lambda i: _one(srv.url, i), range(20)))
        assert [s for s, _, _ in sent].count(200) == 19 and sent[0][0] == 400
        records = wait_until(lambda: (rs := list(read_records(dump))) and len(rs) >= 20 and rs, 15, "20 records")
        assert len(records) == 20
        assert Counter(r.outcome for r in records) == Counter(o for _, _, o in sent)
        by_rid = {r.rid: r for r in records}
        for status, rid, outcome in sent[1:]:
            assert by_rid[rid].outcome == outcome and by_rid[rid].status == (499 if outcome != "length" else 200)
        assert by_rid[sent[1][1]].stream and by_rid[sent[1][1]].completion_tokens == 6
        assert by_rid[sent[1][1]].breakdown["tpot_ms"] > 0 and by_rid[sent[1][1]].params["max_new_tokens"] == 6
        assert {r.route for r in records} == {"/v1/completions", "/v1/chat/completions", "/generate"}
        assert all(r.prompt is None and r.output is None and r.prompt_sha256 for r in records)
        assert all(r.output_sha256 for r in records if r.completion_tokens)
        assert SECRET.encode() not in b"".join(f.read_bytes() for f in dump.glob("requests-*.jsonl"))

        # (2) the directory becomes a file: requests still succeed, the lost records are counted
        before = value(scrape(srv), "sightline_request_dump_errors_total", reason="write_error")
        dump.rename(tmp_path / "dump-moved")
        dump.write_text("not a directory")
        for i in range(2):
            assert srv.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
        wait_until(
            lambda: value(scrape(srv), "sightline_request_dump_errors_total", reason="write_error") == before + 2,
            10,
            "the write errors counted",
        )
        dump.unlink()
        (tmp_path / "dump-moved").rename(dump)

        # (3) kill -9 the Scheduler under a held stream: a complete crash dump
        pids = srv.debug()["pids"]
        rid = []

        def stream() -> None:
            with httpx.stream(
                "POST",
                srv.url + "/v1/completions",
                timeout=60,
                json={"prompt": "long", "max_tokens": 8, "stream": True, **HOLD},
            ) as r:
                rid.append(r.headers["x-request-id"])
                for _ in r.iter_lines():
                    pass

        t = threading.Thread(target=stream)
        t.start()
        srv.wait_held(1)
        os.kill(pids["scheduler"], signal.SIGKILL)
        t.join(30)
        crash = wait_until(lambda: list(dump.glob("crash-*")), 15, "a crash dump")[0]
        failure = json.loads((crash / "failure.json").read_text())
        assert failure["role"] == "scheduler" and failure["signal"] == "SIGKILL" and failure["cause"] == "exited"
        in_flight = json.loads((crash / "in_flight.json").read_text())["requests"]
        assert rid[0] in {r["rid"] for r in in_flight}
        recent = list(read_records(crash / "requests.jsonl"))
        assert any(r.rid == rid[0] and r.outcome == "engine_failure" for r in recent)
        assert len(recent) == 20 + 2 + 1, len(recent)  # (1)'s, (2)'s (lost to the file only), the cut one
        stats = json.loads((crash / "stats.json").read_text())
        assert stats["schedulers"] and stats["detokenizer"] is not None
        detok = (crash / "stacks" / f"detokenizer-{pids['detokenizer']}.txt").read_text()
        assert "serving/detokenizer" in detok, detok
        assert not (crash / "stacks" / f"scheduler-{pids['scheduler']}.txt").exists()
        assert value(scrape(srv), "sightline_crash_dumps_total", result="written") == 1
    finally:
        srv.stop()
