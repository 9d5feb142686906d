"""Real Prometheus, Alertmanager and promtool for the tests: find them, start them, ask them.

A missing tool skips the test with a loud reason, except under CI=true, where it fails:
CI must run the checks, not skip them.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from loadtest.server import free_port
from tests.server_util import wait_until

HOW_TO_INSTALL = "apt-get install prometheus prometheus-alertmanager haproxy (`make setup` does it when run as root)"
REPO = Path(__file__).resolve().parents[1]
PROM_DIR = REPO / "dashboards/prometheus"


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
        self.proc = subprocess.Popen(
            self.command(*args), env=self.environment(), stdout=self._log, stderr=subprocess.STDOUT
        )

    def command(self, *args: str) -> list[str]:
        return [require_tool(self.tool), f"--web.listen-address=127.0.0.1:{self.port}", *args]

    def environment(self) -> dict[str, str] | None:
        return None  # the test's own

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
        if getattr(self, "_client", None) is not None:
            self._client.close()
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
        super().__init__(
            tmpdir,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmpdir / 'tsdb'}",
            "--enable-feature=exemplar-storage",
        )

    def api(self, path: str, **params) -> object:
        if not hasattr(self, "_client"):
            self._client = httpx.Client(timeout=30)  # kept alive; safe to share between threads
        r = self._client.get(f"{self.url}/api/v1/{path}", params=params)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def scraped_after(self, t: float, evaluated: bool = False, targets: int | None = None) -> None:
        """Wait until every active target (`targets` of them, if given) was scraped, and with `evaluated` every
        rule group evaluated, after `t` (Unix seconds): what the targets showed at `t` is in the database."""

        def past() -> bool:
            active = self.api("targets", state="active")["activeTargets"]
            groups = self.api("rules")["groups"] if evaluated else []
            return (
                bool(active)
                and (targets is None or len(active) == targets)
                and all(_unix(x["lastScrape"]) > t for x in active)
                and all(_unix(g["lastEvaluation"]) > t for g in groups)
            )

        self.wait_for(f"a scrape{' and an evaluation' if evaluated else ''} after {t:.3f}", past, 20)


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


class Alertmanager(Daemon):
    tool = "prometheus-alertmanager"

    def __init__(self, tmpdir: Path, config: Path) -> None:
        # --cluster.listen-address= : no gossip port, a lone instance
        super().__init__(
            tmpdir, f"--config.file={config}", f"--storage.path={tmpdir / 'am'}", "--cluster.listen-address="
        )

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


def local_prometheus_config(path: Path, rules_dir: Path, targets: list[str], alertmanager: str | None = None) -> Path:
    """The committed config, scraping and evaluating every second, job `sightline` pointed at
    `targets` (one instance each), alerts sent to `alertmanager` (none: alerts stay in Prometheus)."""
    import yaml

    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(rules_dir / "*.yml")]
    if alertmanager:
        cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager]
    else:
        cfg.pop("alerting")
    cfg["scrape_configs"] = [c for c in cfg["scrape_configs"] if c["job_name"] == "sightline"]
    cfg["scrape_configs"][0]["static_configs"][0]["targets"] = list(targets)
    path.write_text(yaml.safe_dump(cfg))
    return path


def committed_rule_files() -> dict[str, dict]:
    """File name → content of every generated rule file (dashboards/prometheus/rules/)."""
    import yaml

    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((PROM_DIR / "rules").glob("*.yml"))}


def queries_without_data(prom: Prometheus, start: float, end: float) -> tuple[list[str], int]:
    """Every dashboard panel query, template variable and recording rule with no real number in
    [start, end] (as Grafana would run them, every variable at "All"), and how many were evaluated."""
    from concurrent.futures import ThreadPoolExecutor

    from dashboards.lint import panels
    from tests.helpers import boards

    checks = []  # (what, query, is a template variable)
    for uid, board in boards().items():
        for panel in panels(board):
            checks += [
                (f"{uid} / {panel['title']} [{t['refId']}]: {t['expr']}", as_grafana_would(t["expr"]), False)
                for t in panel["targets"]
            ]
        checks += [
            (
                f"{uid} variable ${var['name']}: {var['query']}",
                as_grafana_would(var["query"]).removeprefix("label_values(").rsplit(",", 1)[0],
                True,
            )
            for var in board["templating"]["list"]
        ]
    for rule in (r for f in committed_rule_files().values() for g in f["groups"] for r in g["rules"] if "record" in r):
        slo_name = rule.get("labels", {}).get("slo")
        query = f'{rule["record"]}{{slo="{slo_name}"}}' if slo_name else rule["record"]
        checks.append((f"recording rule {query}", query, False))

    def has_data(check) -> bool:
        _, query, variable = check
        if variable:
            return bool(prom.api("series", **{"match[]": query, "start": start, "end": end}))
        return bool(finite_points(prom.query_range(query, start, end, "2s")))

    with ThreadPoolExecutor(4) as pool:  # a few at once: Prometheus answers each in a few ms of CPU
        found = list(pool.map(has_data, checks))
    missing = [what for (what, _, _), ok in zip(checks, found) if not ok]
    return missing, sum(not variable for _, _, variable in checks)


HAPROXY_CFG = Path(__file__).resolve().parents[1] / "deploy/haproxy/haproxy.cfg"


class HAProxy(Daemon):
    """`haproxy -f deploy/haproxy/haproxy.cfg` in the foreground, pointed at `replicas`."""

    tool = "haproxy"

    def __init__(self, tmpdir: Path, replicas: list[str]) -> None:
        self.stats_port, self.replicas = free_port(), replicas
        super().__init__(tmpdir)

    def command(self, *args: str) -> list[str]:
        return [require_tool(self.tool), "-db", "-f", str(HAPROXY_CFG)]

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "SIGHTLINE_LB_BIND": f"127.0.0.1:{self.port}",
            "SIGHTLINE_LB_STATS": f"127.0.0.1:{self.stats_port}",
            **{f"SIGHTLINE_REPLICA_{i + 1}": r for i, r in enumerate(self.replicas)},
        }

    def servers(self) -> dict[str, dict]:
        """HAProxy's stats of each server of backend `sightline` (status, stot = requests sent, ...)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "sightline" and r["svname"].startswith("replica")}

    def wait_all(self, status: str, names, timeout: float = 30) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.log_path.read_text()}")
            try:
                return all(self.servers()[n]["status"].startswith(status) for n in names)
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, f"HAProxy: {sorted(names)} {status}", interval=0.1)
