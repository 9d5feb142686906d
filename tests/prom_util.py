"""Real Prometheus, Alertmanager and promtool for the tests: find them, start them, ask them.

A missing tool skips the test with a loud reason, except under CI=true, where it fails:
CI must run the checks, not skip them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from loadtest.server import free_port
from tests.server_util import wait_until

HOW_TO_INSTALL = "apt-get install prometheus prometheus-alertmanager (`make setup` does it when run as root)"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"`{name}` is not on PATH: {HOW_TO_INSTALL}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {message}")
    pytest.skip(f"!!! SKIPPED, NOT TESTED !!! {message}")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


class Daemon:
    """A server binary on a free loopback port, its output in a log file, stopped on exit."""

    tool = ""

    def __init__(self, tmpdir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmpdir / f"{self.tool}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([require_tool(self.tool), f"--web.listen-address=127.0.0.1:{self.port}", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.tool} exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        self.wait_for(f"{self.tool} ready", self._ready, timeout)

    def wait_for(self, what: str, check, timeout: float):
        """Poll `check()` until it returns something truthy; fail naming `what`, with the log."""
        try:
            return wait_until(check, timeout, what, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- {self.tool} log ---\n{self.log()[-3000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Prometheus(Daemon):
    tool = "prometheus"

    def __init__(self, tmpdir: Path, config: Path) -> None:
        super().__init__(tmpdir, f"--config.file={config}", f"--storage.tsdb.path={tmpdir / 'tsdb'}",
                         "--enable-feature=exemplar-storage")

    def api(self, path: str, **params) -> object:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]


class Alertmanager(Daemon):
    tool = "prometheus-alertmanager"

    def __init__(self, tmpdir: Path, config: Path) -> None:
        # --cluster.listen-address= : no gossip port, a lone instance
        super().__init__(tmpdir, f"--config.file={config}", f"--storage.path={tmpdir / 'am'}",
                         "--cluster.listen-address=")

    def post_alerts(self, alerts: list[dict]) -> None:
        httpx.post(f"{self.url}/api/v2/alerts", json=alerts, timeout=10).raise_for_status()


def finite_points(series: list[dict]) -> int:
    """Points of a query_range result that are real numbers (not NaN or ±Inf)."""
    return sum(1 for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf"))


TEMPLATE_VARS = re.compile(r"\$(job|instance|model_name)\b")


def as_grafana_would(expr: str, rate_interval: str = "30s") -> str:
    """A panel query with its variables filled in: every template variable at "All" (`.*`)."""
    return TEMPLATE_VARS.sub(".*", expr.replace("$__rate_interval", rate_interval))


def exposed_names(exposition: str) -> set[str]:
    """Every sample name in a /metrics text exposition (`x_bucket`, `x_count`, ... included)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(exposition) for s in fam.samples}
