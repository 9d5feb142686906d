"""Alertmanager webhook receiver that prints every notification: the stack's stand-in pager.

    python webhook_log.py [--port 9099]

One JSON line per alert on stdout: receiver (the URL path: /page, /ticket), status,
alertname, severity and labels.  Standard library only, so the compose stack runs it
on a plain Python image; the live test (tests/e2e/test_alerting.py) receives its alerts
through the same class.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Sink = Callable[[dict], None]


def _handler(sink: Sink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            for alert in body.get("alerts", []):
                labels = alert.get("labels", {})
                sink(
                    {
                        "receiver": self.path.strip("/"),
                        "status": alert.get("status"),
                        "alertname": labels.get("alertname"),
                        "severity": labels.get("severity"),
                        "labels": labels,
                    }
                )
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:  # one line per alert is enough
            pass

    return Handler


class WebhookLog:
    """A webhook receiver on a thread; `sink` gets one dict per alert."""

    def __init__(self, sink: Sink, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = ThreadingHTTPServer((host, port), _handler(sink))
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "WebhookLog":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    ap = argparse.ArgumentParser(description="Print Alertmanager notifications.")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9099)
    args = ap.parse_args()
    print(f"alert-log listening on {args.host}:{args.port}", flush=True)
    with WebhookLog(lambda a: print(json.dumps(a, sort_keys=True), flush=True), args.host, args.port) as log:
        try:
            log.thread.join()
        except KeyboardInterrupt:
            sys.exit(0)


if __name__ == "__main__":
    main()
