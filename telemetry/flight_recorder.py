"""The flight recorder (`--dump-requests DIR`): one `RequestRecord` per request that reached a
generation route, written as JSON lines off the event loop, in rotating size-bounded files.

`RequestTelemetry.finish` and `rejected` call `record` (on the event loop): it builds the
record from the request's state, keeps it in an in-memory ring (the last
`--crash-dump-requests`, for crash dumps) and puts it on a bounded queue.  One writer
thread drains the queue: it hashes the prompt, encodes the lines and appends them to
`requests-<UTC time>-<n>.jsonl` (`requests-w<worker>-...` in a tokenizer worker), starting
a new file at `--dump-requests-max-file-mb` and deleting the oldest `requests-*.jsonl` of
DIR beyond `--dump-requests-max-files`: the directory's size is bounded whatever the number
of writers.  A full queue drops the record, a failed write (full disk, directory gone or
unwritable) loses it: both are counted (`sightline_request_dump_errors_total{reason}`) and
logged at most once per `LOG_INTERVAL`, and no request ever fails for it.

The output is never kept whole unless `--dump-content`: `on_output` folds each text delta
into a running SHA-256 and a character count.  Without a DIR (crash dumps only, with
`--crash-dump-dir`) only the ring is kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from telemetry.clock import now_ns
from telemetry.request_record import FILE_GLOB, RequestRecord, encode

log = logging.getLogger("sightline.flight_recorder")
QUEUE_SIZE = 4096  # records waiting for the writer; beyond it they are dropped and counted
LOG_INTERVAL = 10.0  # seconds between log lines about dump errors
WRITE_ERROR, QUEUE_FULL = "write_error", "queue_full"


class OutputDigest:
    """A request's output text as it streams: its length and running SHA-256 (and the text itself
    only with --dump-content)."""

    __slots__ = ("chars", "sha", "parts")

    def __init__(self, keep: bool) -> None:
        self.chars, self.sha = 0, hashlib.sha256()
        self.parts: list[str] | None = [] if keep else None

    def add(self, text: str) -> None:
        self.chars += len(text)
        self.sha.update(text.encode("utf-8", "surrogatepass"))
        if self.parts is not None:
            self.parts.append(text)


def _prompt_digest(prompt: Any) -> tuple[int, str]:
    """(characters, SHA-256): of the text; of the messages' contents and their compact JSON; of a
    token-id list's compact JSON (its length as the characters)."""
    if isinstance(prompt, str):
        return len(prompt), hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in prompt)
    else:
        chars = len(prompt or ())
    return chars, hashlib.sha256(msgspec.json.encode(prompt)).hexdigest()


def sampling_params(obj: Any, admitted: bool) -> dict:
    """The sampling parameters of a `GenerateReqInput` as the engine ran them and its stop-string
    count; `max_new_tokens` is the one run (filled in from the context when the client gave none)
    once admitted, else the client's (absent if it gave none)."""
    params = msgspec.structs.asdict(obj.sampling)
    if not admitted:
        params.pop("max_new_tokens")
        if obj.max_new_tokens is not None:
            params["max_new_tokens"] = obj.max_new_tokens
    params["stop_token_ids"] = len(params.get("stop_token_ids") or ())
    params["stop"] = len(obj.stop)
    params["skip_special_tokens"] = obj.skip_special_tokens
    return params


def _params(obj: Any, admitted: bool) -> dict:
    """The record's params: an embeddings request's own (`record_params`), else the sampling parameters."""
    if obj is None:
        return {}
    return obj.record_params() if hasattr(obj, "record_params") else sampling_params(obj, admitted)


class FlightRecorder:
    def __init__(
        self,
        directory: str | None,
        model: str,
        *,
        content: bool = False,
        max_file_mb: float = 64.0,
        max_files: int = 10,
        ring: int = 200,
        prefix: str = "requests-",
        metrics: Any = None,
    ) -> None:
        self.dir = Path(directory) if directory else None
        self.model, self.content, self.prefix, self.m = model, content, prefix, metrics
        self.max_bytes, self.max_files = max(1, int(max_file_mb * 1024 * 1024)), max(1, max_files)
        self.ring: deque[tuple[RequestRecord, Any]] = deque(maxlen=max(0, ring))
        self.errors = {WRITE_ERROR: 0, QUEUE_FULL: 0}
        self.written = 0
        self._q: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._file = None
        self._path: Path | None = None
        self._seq = 0
        self._last_log = float("-inf")
        self._unlogged = 0
        self._thread = None
        if self.dir is not None:
            self._thread = threading.Thread(target=self._run, name="flight-recorder", daemon=True)
            self._thread.start()

    # -- the event loop's side ------------------------------------------------------
    def on_output(self, rt: Any, text: str) -> None:
        if text:
            if rt.trace.dump_output is None:
                rt.trace.dump_output = OutputDigest(self.content)
            rt.trace.dump_output.add(text)

    def record(self, rt: Any, outcome: str, finish_reason: str | None, status: int) -> None:
        """The request ended (its breakdown and trace id final): keep it in the ring and queue it."""
        try:
            self._record(rt, outcome, finish_reason, status)
        except Exception as exc:  # noqa: BLE001 - a record is never worth failing a request over
            self._error(WRITE_ERROR, "could not build a request record", exc)

    def _record(self, rt: Any, outcome: str, finish_reason: str | None, status: int) -> None:
        breakdown = dict(rt.breakdown or {})
        breakdown.pop("trace_id", None)
        breakdown.pop("cached_tokens", None)
        breakdown.pop("retractions", None)
        if "e2e_ms" not in breakdown:
            breakdown["e2e_ms"] = round((now_ns() - rt.arrival) / 1e6, 3)
        n, ttft = rt.completion_tokens, breakdown.get("ttft_ms")
        if n >= 2 and ttft is not None:
            breakdown["tpot_ms"] = round((breakdown["e2e_ms"] - ttft) / (n - 1), 3)
        obj, out = rt.trace.dump_input, rt.trace.dump_output or OutputDigest(self.content)
        rec = RequestRecord(
            arrival=round(time.time() - (now_ns() - rt.arrival) / 1e9, 6),
            rid=rt.rid,
            route=rt.route,
            operation=rt.operation,
            model=self.model,
            stream=rt.stream,
            tenant=getattr(rt, "tenant", "default"),
            user=getattr(obj, "user", None),
            params=_params(obj, bool(rt.rid)),
            prompt_tokens=rt.prompt_tokens,
            completion_tokens=n,
            cached_tokens=rt.cached_tokens,
            retractions=rt.retractions,
            outcome=outcome,
            finish_reason=finish_reason,
            status=status,
            breakdown=breakdown,
            trace_id=rt.trace.trace_id,
            output_chars=out.chars,
            output_sha256=out.sha.hexdigest(),
        )
        prompt = None if obj is None else obj.messages if obj.messages is not None else obj.prompt
        failure = getattr(rt, "tool_call_failure", None)
        if failure is not None:
            rec.tool_call_parse_failed = failure[0]
            rec.tool_call_text = failure[1] if self.content else None
        if self.content:
            rec.output = "".join(out.parts or ())
            if obj is not None and obj.stop:
                rec.params["stop_strings"] = list(obj.stop)
        item = (rec, prompt)
        self.ring.append(item)
        if self.dir is None:
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self._error(QUEUE_FULL, "the flight recorder's queue is full; records are being dropped")

    def recent(self) -> list[tuple[RequestRecord, Any]]:
        """The ring's records, oldest first (for a crash dump; complete them with `line`)."""
        return list(self.ring)

    def line(self, item: tuple[RequestRecord, Any]) -> bytes:
        """One record as its JSON line, the prompt's digest (and text, with --dump-content) filled in."""
        rec, prompt = item
        if prompt is not None and not rec.prompt_sha256:
            rec.prompt_chars, rec.prompt_sha256 = _prompt_digest(prompt)
            if self.content:
                rec.prompt = prompt
        return encode(rec) + b"\n"

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued and close the file (at shutdown)."""
        if self._thread is not None and self._thread.is_alive():
            try:
                self._q.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)

    # -- the writer thread ---------------------------------------------------------------
    def _error(self, reason: str, what: str, exc: BaseException | None = None) -> None:
        self.errors[reason] += 1
        if self.m is not None:
            self.m.request_dump_errors.labels(reason).inc()
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the previous line)" if self._unlogged else ""
        self._last_log, self._unlogged = now, 0
        log.error("%s%s%s", what, f": {exc}" if exc else "", more)

    def _run(self) -> None:
        stop = False
        while not stop:
            items = [self._q.get()]
            while len(items) < 512:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            if items[-1] is None or None in items:
                stop = True
                items = [i for i in items if i is not None]
            for item in items:
                try:
                    self._write(self.line(item))
                except Exception as exc:  # noqa: BLE001 - a failed write loses one record, never a request
                    self._close_file()
                    self._error(WRITE_ERROR, f"could not write a request record to {self.dir}", exc)
        self._close_file()

    def _write(self, data: bytes) -> None:
        if self._file is not None and (self._file.tell() + len(data) > self.max_bytes or not self._still_there()):
            self._close_file()
        if self._file is None:
            self._open()
        view = memoryview(data)
        while view:  # unbuffered: a record is on disk (or counted lost) once written
            view = view[self._file.write(view) :]
        self.written += 1
        if self.m is not None:
            self.m.request_dump_records.inc()

    def _still_there(self) -> bool:
        """The open file is still the one at its path (not deleted, its directory not replaced)."""
        try:
            return os.stat(self._path).st_ino == os.fstat(self._file.fileno()).st_ino
        except OSError:
            return False

    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._path = self.dir / f"{self.prefix}{stamp}-{self._seq:04d}.jsonl"
        self._file = open(self._path, "ab", buffering=0)
        self._prune()

    def _prune(self) -> None:
        """Keep at most max_files request files in the directory (every writer's): the oldest go."""
        files = []
        for f in self.dir.glob(FILE_GLOB):
            try:
                files.append((f.stat().st_mtime, f.name, f))
            except OSError:
                continue
        files.sort()
        for _, _, f in files[: max(0, len(files) - self.max_files)]:
            if f != self._path:
                f.unlink(missing_ok=True)

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
