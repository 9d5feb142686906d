"""Error logging that a flood of bad input cannot turn into a flood of log lines.

The engine processes survive malformed messages and failing requests; each one is
counted, but at most one line per `interval` seconds is logged, saying how many were
left unlogged since the previous line.
"""

from __future__ import annotations

import logging
import time
import traceback


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 1.0, level: int = logging.ERROR) -> None:
        self.logger = logger
        self.interval = interval
        self.level = level
        self.count = 0  # cumulative: every call, logged or not
        self._unlogged = 0
        self._last = float("-inf")

    def report(self, what: str, exc: BaseException | None = None) -> bool:
        """Count one failure; log it (one line) unless a line went out less than `interval` ago."""
        self.count += 1
        now = time.monotonic()
        if now - self._last < self.interval:
            self._unlogged += 1
            return False
        self._last = now
        detail = f": {describe(exc)}" if exc is not None else ""
        more = f" ({self._unlogged} more since the previous line)" if self._unlogged else ""
        self._unlogged = 0
        self.logger.log(self.level, "%s%s%s", what, detail, more)
        return True


def describe(exc: BaseException) -> str:
    """`Type: message at file:line in function` (the innermost frame), on one line."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        text += f" at {f.filename}:{f.lineno} in {f.name}"
    return text
