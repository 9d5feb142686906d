"""The flight recorder without a server: record fields with and without --dump-content, rotation
and retention, errors counted and never raised; and the crash dump's stack path against a real
stopped process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from protocol.sampling_params import SamplingParams
from serving.frontend.supervision.crash_dump import CrashDumper
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState
from telemetry import flight_recorder
from telemetry.clock import now_ns
from telemetry.flight_recorder import FlightRecorder
from telemetry.metrics import Metrics
from telemetry.request_record import read_records
from tests.helpers import REPO

PROMPT = "The secret prompt"


def finished(i: int = 0, outputs=("Hello", " world"), stream: bool = False) -> ReqState:
    """A request that ran: built, tokenized, produced `outputs`, finished with a breakdown."""
    obj = GenerateReqInput(
        sampling=SamplingParams(max_new_tokens=8, temperature=0.5, seed=7, stop_token_ids=[3, 4]),
        prompt=PROMPT,
        stop=["\n"],
        stream=stream,
    )
    rt = ReqState(route="/v1/completions", operation="text_completion", arrival=now_ns() - 50_000_000, stream=stream)
    rt.rid, rt.prompt_tokens, rt.completion_tokens, rt.cached_tokens = f"rid{i}", 5, len(outputs), 2
    rt.retractions = 1
    rt.trace.dump_input = obj
    rt.breakdown = {
        "ttft_ms": 10.0,
        "queue_ms": 1.0,
        "e2e_ms": 40.0,
        "cached_tokens": 2,
        "retractions": 1,
        "trace_id": "x",
    }
    return rt


def run(rec: FlightRecorder, rt: ReqState, outputs=("Hello", " world"), outcome="stop") -> None:
    for text in outputs:
        rec.on_output(rt, text)
    rec.record(rt, outcome, "stop", 200)


def test_a_record_has_the_request_without_its_text(tmp_path):
    metrics = Metrics("m")
    rec = FlightRecorder(str(tmp_path), "m", metrics=metrics)
    rt = finished()
    rt.trace.trace_id = "ab" * 16
    run(rec, rt)
    refused = ReqState(route="/v1/chat/completions", operation="chat", arrival=now_ns())
    rec.record(refused, "rejected", "error", 400)
    shed = ReqState(route="/v1/completions", operation="text_completion", arrival=now_ns())
    shed.trace.dump_input = GenerateReqInput(sampling=SamplingParams(), prompt="p")  # no max_tokens, never admitted
    rec.record(shed, "shed", "error", 429)
    rec.close()
    r, bad, full = read_records(tmp_path)
    assert "max_new_tokens" not in full.params and full.params["temperature"] == 1.0 and full.prompt_chars == 1
    assert r.rid == "rid0" and r.route == "/v1/completions" and r.model == "m" and r.outcome == "stop"
    assert r.params["max_new_tokens"] == 8 and r.params["temperature"] == 0.5 and r.params["seed"] == 7
    assert r.params["stop"] == 1 and r.params["stop_token_ids"] == 2 and "stop_strings" not in r.params
    assert r.prompt is None and r.output is None
    assert r.prompt_chars == len(PROMPT) and r.prompt_sha256 == hashlib.sha256(PROMPT.encode()).hexdigest()
    assert r.output_chars == 11 and r.output_sha256 == hashlib.sha256(b"Hello world").hexdigest()
    assert r.breakdown["tpot_ms"] == 30.0 and "trace_id" not in r.breakdown and r.trace_id == "ab" * 16
    assert r.prompt_tokens == 5 and r.completion_tokens == 2 and r.cached_tokens == 2 and r.retractions == 1
    assert "retractions" not in r.breakdown and bad.retractions == 0
    assert abs(r.arrival - (time.time() - 0.05)) < 5
    assert bad.outcome == "rejected" and bad.status == 400 and bad.params == {} and bad.breakdown["e2e_ms"] >= 0
    assert metrics.request_dump_records._value.get() == 3
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("requests-*.jsonl"))
    assert PROMPT.encode() not in raw and b"Hello" not in raw


def test_dump_content_records_the_texts(tmp_path):
    rec = FlightRecorder(str(tmp_path), "m", content=True)
    run(rec, finished())
    chat = finished(1, outputs=("ok",))
    chat.trace.dump_input.prompt, chat.trace.dump_input.messages = None, [{"role": "user", "content": "hi there"}]
    run(rec, chat, outputs=("ok",))
    rec.close()
    a, b = read_records(tmp_path)
    assert a.prompt == PROMPT and a.output == "Hello world" and a.params["stop_strings"] == ["\n"]
    assert b.prompt == [{"role": "user", "content": "hi there"}] and b.prompt_chars == 8 and b.output == "ok"
    assert "tpot_ms" not in b.breakdown  # one output token


@pytest.mark.parametrize("content", [False, True])
def test_a_tool_call_that_did_not_parse_is_named_and_its_text_kept_only_with_content(tmp_path, content):
    rec = FlightRecorder(str(tmp_path), "m", content=content)
    rt = finished(outputs=("<tool_call>{oops",))
    rt.tool_call_failure = ("hermes", "<tool_call>{oops")
    run(rec, rt, outputs=("<tool_call>{oops",))
    rec.close()
    (r,) = read_records(tmp_path)
    assert r.tool_call_parse_failed == "hermes" and r.tool_call_text == ("<tool_call>{oops" if content else None)


def test_files_rotate_and_the_oldest_go(tmp_path):
    rec = FlightRecorder(str(tmp_path), "m", max_file_mb=2 / 1024, max_files=3, ring=10, prefix="requests-w2-")
    for i in range(60):
        run(rec, finished(i))
    rec.close()
    files = sorted(tmp_path.glob("requests-w2-*.jsonl"))
    assert len(files) == 3 and all(f.stat().st_size <= 2048 for f in files), [f.stat().st_size for f in files]
    got = [r.rid for r in read_records(tmp_path)]
    assert got == [f"rid{i}" for i in range(60 - len(got), 60)]  # the newest, in order
    assert rec.written == 60 and len(rec.recent()) == 10 and rec.recent()[-1][0].rid == "rid59"


def test_an_unwritable_directory_is_counted_never_raised(tmp_path):
    metrics = Metrics("m")
    target = tmp_path / "dump"
    target.write_text("a file where the directory should be")
    rec = FlightRecorder(str(target), "m", metrics=metrics, ring=5)
    for i in range(3):
        run(rec, finished(i))
    rec.close()
    assert rec.errors["write_error"] == 3 and rec.written == 0 and len(rec.recent()) == 3
    assert metrics.request_dump_errors.labels("write_error")._value.get() == 3


def test_a_deleted_directory_is_noticed(tmp_path):
    rec = FlightRecorder(str(tmp_path / "d"), "m")
    run(rec, finished(0))
    deadline = time.monotonic() + 5
    while rec.written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    for f in (tmp_path / "d").iterdir():
        f.unlink()
    (tmp_path / "d").rmdir()
    (tmp_path / "d").write_text("now a file")
    run(rec, finished(1))
    rec.close()
    assert rec.written == 1 and rec.errors["write_error"] == 1


def test_a_full_queue_drops_and_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(flight_recorder, "QUEUE_SIZE", 2)
    gate = threading.Event()
    rec = FlightRecorder(str(tmp_path), "m")
    real = rec._write
    rec._write = lambda data: (gate.wait(10), real(data))
    for i in range(10):
        run(rec, finished(i))
    gate.set()
    rec.close()
    assert rec.errors["queue_full"] >= 6 and rec.written + rec.errors["queue_full"] == 10


STALLED = textwrap.dedent("""
    import sys, time
    from serving.process import enable_stack_dumps
    enable_stack_dumps(sys.argv[1])
    def stuck_in_a_step():
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
    stuck_in_a_step()
""")


def test_a_crash_dump_has_a_stopped_childs_stack(tmp_path):
    """The stall path: the child is stopped (SIGSTOP), its stack is still had (continued, then asked)."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    child = subprocess.Popen([sys.executable, "-c", STALLED, str(runtime)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert child.stdout.readline() == b"ready\n"
        os.kill(child.pid, signal.SIGSTOP)
        wait_stopped = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < wait_stopped:
            time.sleep(0.01)  # SIGSTOP takes effect when the child is next scheduled
        proc = SimpleNamespace(pid=child.pid, exitcode=None, is_alive=lambda: child.poll() is None)
        dead = SimpleNamespace(pid=1 << 22, exitcode=-9, is_alive=lambda: False)
        monitor = SimpleNamespace(
            procs={"scheduler": proc, "detokenizer": dead},
            restart_status=None,
            ranks=lambda: [],
            detok_stats=None,
            last_heartbeat={},
        )
        metrics = Metrics("m")
        recorder = FlightRecorder(None, "m", ring=3)
        for i in range(5):
            run(recorder, finished(i))
        dumper = CrashDumper(
            str(tmp_path / "dumps"),
            monitor,
            str(runtime),
            metrics,
            recorder=recorder,
            in_flight=lambda: [{"rid": "r1", "state": "running"}],
        )

        async def crash():
            pending = await dumper.begin("scheduler", "stalled", "sent no heartbeat")
            await dumper.finish(pending)

        asyncio.run(crash())
        for t in dumper.threads:
            t.join(10)
        (dump,) = (tmp_path / "dumps").glob("crash-*")
        stack = (dump / "stacks" / f"scheduler-{child.pid}.txt").read_text()
        assert "stuck_in_a_step" in stack, stack
        assert list((dump / "stacks").glob("main-*.txt"))
        failure = json.loads((dump / "failure.json").read_text())
        assert failure["cause"] == "stalled" and failure["pid"] == child.pid
        assert any("detokenizer" in m for m in failure["missing"])
        assert [r.rid for r in read_records(dump / "requests.jsonl")] == ["rid2", "rid3", "rid4"]
        assert json.loads((dump / "in_flight.json").read_text())["requests"][0]["rid"] == "r1"
        assert metrics.crash_dumps.labels("written")._value.get() == 1
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("code,name", [(-9, "SIGKILL"), (1, None)])
def test_the_failure_names_the_signal(tmp_path, code, name):
    proc = SimpleNamespace(pid=123, exitcode=code, is_alive=lambda: False)
    monitor = SimpleNamespace(
        procs={"scheduler": proc}, restart_status=None, ranks=lambda: [], detok_stats=None, last_heartbeat={}
    )
    pending = asyncio.run(CrashDumper(str(tmp_path), monitor, str(tmp_path)).begin("scheduler", "exited", "x"))
    assert pending.failure["exit_code"] == code and pending.failure["signal"] == name
