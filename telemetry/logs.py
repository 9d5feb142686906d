"""Logs as JSON lines: every line names its process role and, when it concerns a
request, its `rid`, `trace_id` and `span_id` — so a log line, a metric exemplar and a
trace lead to each other.  Prompts and outputs are never logged.
"""

from __future__ import annotations

import json
import logging
import sys
import time

REQUEST_LOGGER = "sightline.request"
_EXTRA_KEYS = ("rid", "trace_id", "span_id")
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.role,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(role: str, level: str = "info", fmt: str = "json") -> None:
    """Root logging for one process (idempotent): JSON lines or plain text on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JSONFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())


def log_request(fields: dict) -> None:
    """One INFO line per finished request: ids, outcome, token counts and the breakdown."""
    logging.getLogger(REQUEST_LOGGER).info("request finished", extra=fields)
