"""Record real SSE streams from a tiny-random server into tests/fixtures/sse/ (parser test data).

    .venv/bin/python -m loadtest.record_fixtures [--out tests/fixtures/sse]

Starts its own server, saves each response body byte for byte, and writes
`manifest.json` with what each stream must parse to — taken from the request (max_tokens
with ignore_eos pins finish_reason and completion_tokens), not from our parser.  The last
recording is a stream cut by the server's shutdown (SIGTERM): an error event, then [DONE].
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
from pathlib import Path

import httpx

from loadtest.server import REPO, LocalServer

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
CASES = {  # name → (path, body, expected)
    "chat_usage": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 12, "ignore_eos": True, "stream_options": {"include_usage": True}},
        {"finish_reason": "length", "completion_tokens": 12, "error": None},
    ),
    "chat_no_usage": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 6, "ignore_eos": True},
        {"finish_reason": "length", "completion_tokens": None, "error": None},
    ),
    "completions_usage": (
        "/v1/completions",
        {
            "prompt": "The capital of France is",
            "max_tokens": 10,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
        {"finish_reason": "length", "completion_tokens": 10, "error": None},
    ),
    "completions_token_ids": (
        "/v1/completions",
        {
            "prompt": list(range(1000, 1040)),
            "max_tokens": 5,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
        {"finish_reason": "length", "completion_tokens": 5, "prompt_tokens": 40, "error": None},
    ),
}


def record(url: str, path: str, body: dict) -> bytes:
    body = {"stream": True, "temperature": 0, **body}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        r.raise_for_status()
        return b"".join(r.iter_raw())


def record_shutdown(server: LocalServer) -> bytes:
    """A long stream; SIGTERM to the server once it has started: the in-flight request is ended
    with an error event and [DONE]."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = bytearray()
    started = threading.Event()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for chunk in r.iter_raw():
            got += chunk
            if got.count(b"data: ") >= 3 and not started.is_set():
                started.set()
                server.proc.send_signal(signal.SIGTERM)
    return bytes(got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "sse")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer("tiny-random", 0, Path(tmp) / "server.log", [])
        try:
            for name, (path, body, expected) in CASES.items():
                (a.out / f"{name}.sse").write_bytes(record(server.url, path, body))
                manifest[name] = {"request": {"path": path, **body}, "expect": {**expected, "done": True}}
            (a.out / "shutdown_error.sse").write_bytes(record_shutdown(server))
            manifest["shutdown_error"] = {
                "request": "a 1500-token completion; SIGTERM to the server mid-stream",
                "expect": {"finish_reason": "abort", "status": 503, "error": "error event: *", "done": True},
            }
        finally:
            server.stop()
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"recorded {len(manifest)} streams into {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
