"""Prometheus rules and Alertmanager routing, checked by the real tools.

promtool checks the config and the rules and runs the generated unit tests (every alert
fires for its situation and stays silent for a healthy series); a mutated burn factor
must make those tests fail; a real Alertmanager must route pages and tickets and let a
page silence its ticket twin.  Last, the live check: a real server under load, a real
Prometheus and Alertmanager — a stalled engine pages, a killed engine process pages, and
with the 429s, 504s and engine restart the test provokes, every dashboard query and
recording rule returns data.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path

import yaml

from dashboards import generate, rule_tests, slo
from dashboards.alertmanager.webhook_log import WebhookLog
from dashboards.lint import expr_problems, rule_exprs
from dashboards.lint import metric_names as lint_names
from tests.prom_util import (
    Alertmanager,
    committed_rule_files,
    local_prometheus_config,
    promtool,
    queries_without_data,
    require_tool,
)
from tests.server_util import HOLD, push_frames, wait_until

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "dashboards/prometheus"
AM_CONFIG = REPO / "dashboards/alertmanager/alertmanager.yml"
RUNBOOK = REPO / "docs/runbook.md"


def rule_files() -> dict[str, dict]:
    return committed_rule_files()


def alert_rules() -> list[dict]:
    return [r for f in rule_files().values() for g in f["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_config_and_rules():
    r = promtool("check", "config", "prometheus.yml", cwd=PROM_DIR)  # also checks the rule files it names
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rule_files())} rule files found" in r.stdout
    r = promtool("check", "rules", *map(str, sorted((PROM_DIR / "rules").glob("*.yml"))))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_pass():
    files = sorted((PROM_DIR / "tests").glob("*.yml"))
    r = promtool("test", "rules", *map(str, files))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(files) == len(rule_files()), r.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    fired: dict[str, set] = {}
    silent: set[str] = set()
    for path in (PROM_DIR / "tests").glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                if case["exp_alerts"]:
                    fired.setdefault(case["alertname"], set()).update(
                        a["exp_labels"]["severity"] for a in case["exp_alerts"]
                    )
                else:
                    silent.add(case["alertname"])
    for rule in alert_rules():
        name, severity = rule["alert"], rule["labels"]["severity"]
        assert severity in fired.get(name, ()), f"no unit test where {name} fires as {severity}"
        assert name in silent, f"no unit test where {name} stays silent"


def test_alerts_are_documented_and_follow_the_workbook():
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.M)
    }
    for rule in alert_rules():
        ann = rule["annotations"]
        assert ann.get("summary") and ann.get("description"), rule["alert"]
        page, _, anchor = ann["runbook_url"].partition("#")
        assert page == "docs/runbook.md" and anchor in anchors, f"{rule['alert']}: no runbook entry #{anchor}"
        assert rule["labels"]["severity"] in ("page", "ticket")
        if "slo" in rule["labels"]:
            assert "for" not in rule, f"{rule['alert']}: burn-rate alerts take no `for:`"
    records = [r["record"] for f in rule_files().values() for g in f["groups"] for r in g["rules"] if "record" in r]
    assert records and all(re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", n) for n in records), records
    for name, expr in [e for f in rule_files().values() for e in rule_exprs(f)]:
        assert expr_problems(expr, dashboard=False) == [], name


def test_slo_thresholds_must_be_bucket_boundaries(tmp_path):
    spec = slo.SPEC_PATH.read_text().replace("threshold: 1.0", "threshold: 0.9")
    (tmp_path / "slo.yaml").write_text(spec)
    try:
        slo.load(tmp_path / "slo.yaml")
    except ValueError as e:
        assert "not a bucket boundary" in str(e)
    else:
        raise AssertionError("a TTFT threshold of 0.9 s (no such bucket) was accepted")


def test_unit_tests_catch_a_wrong_burn_factor(tmp_path):
    """The promtool tests are not vacuous: rules with the fast page factor at 30 fail them."""
    base = slo.load()
    wrong = {"page": (slo.Window("1h", "5m", 30), base.burn_rates["page"][1]), "ticket": base.burn_rates["ticket"]}
    generate.write(tmp_path, generate.rule_outputs(dataclasses.replace(base, burn_rates=wrong)))
    tests = rule_tests.slo_tests(base)
    tests["tests"] = [t for t in tests["tests"] if t["name"].startswith("availability:")]
    generate.write(tmp_path, {"prometheus/tests/slo_test.yml": generate.dump_yaml(tests)})
    r = promtool("test", "rules", str(tmp_path / "prometheus/tests/slo_test.yml"))
    assert r.returncode != 0 and "availability: 1h page pair" in r.stdout + r.stderr, r.stdout


def local_alertmanager_config(path: Path, webhook_port: int) -> Path:
    """The committed config, with fast timers and receivers pointed at a local webhook."""
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    for route in [cfg["route"], *cfg["route"].get("routes", [])]:
        route.update(group_wait="1s", group_interval="1s")
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"http://127.0.0.1:{webhook_port}/{receiver['name']}"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_amtool_accepts_the_config():
    import subprocess

    r = subprocess.run([require_tool("amtool"), "check-config", str(AM_CONFIG)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_routes_pages_and_inhibits_their_ticket_twins(tmp_path):
    got: list[dict] = []
    base = {"job": "sightline", "model_name": "m"}

    def alert(name: str, severity: str, slo_name: str) -> dict:
        return {
            "labels": {"alertname": name, "severity": severity, "slo": slo_name, **base},
            "annotations": {"summary": "test"},
        }

    def known() -> dict[tuple[str, str], dict]:
        """(alertname, severity) → status of each alert Alertmanager holds."""
        import httpx

        alerts = httpx.get(f"{am.url}/api/v2/alerts", timeout=10).json()
        return {(a["labels"]["alertname"], a["labels"]["severity"]): a["status"] for a in alerts}

    with WebhookLog(got.append) as hook:
        with Alertmanager(tmp_path, local_alertmanager_config(tmp_path / "am.yml", hook.port)) as am:
            am.post_alerts([alert("SightlineTTFTBudgetBurn", "page", "ttft")])
            am.wait_for("the page known", lambda: ("SightlineTTFTBudgetBurn", "page") in known(), 10)
            am.post_alerts(
                [alert("SightlineTTFTBudgetBurn", "ticket", "ttft"), alert("SightlineTPOTBudgetBurn", "ticket", "tpot")]
            )
            am.wait_for("two notifications", lambda: len(got) >= 2, 20)
            time.sleep(2)  # clock: two more group intervals (1 s): the inhibited twin must still be missing
            status = known()
    assert status[("SightlineTTFTBudgetBurn", "ticket")]["state"] == "suppressed", status
    assert status[("SightlineTTFTBudgetBurn", "ticket")]["inhibitedBy"], status
    assert status[("SightlineTPOTBudgetBurn", "ticket")]["state"] == "active", status
    seen = sorted((a["receiver"], a["alertname"], a["severity"]) for a in got)
    assert seen == [("page", "SightlineTTFTBudgetBurn", "page"), ("ticket", "SightlineTPOTBudgetBurn", "ticket")], got


# -- the live stack: a real server under load, a real Prometheus and Alertmanager --------
LIVE_RULES = {"SightlineEngineStalled": {"threshold": 2, "for": "0s"}}  # stall after 2 s, fire at once
QUEUE = 8  # the live server's --max-queued-requests: above _load's 6 concurrent requests
BURST = QUEUE + 4  # sent while the engine is stopped: QUEUE - 1 wait (behind the stalled stream), the rest are shed


async def _load(url: str) -> list[int]:
    """A few dozen requests: plain, streamed, walked away from mid-stream, invalid, embeddings, structured outputs
    and a tool call that does not parse."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        gate = asyncio.Semaphore(6)

        async def plain(i: int) -> int:  # with objectives (every other one missed): the goodput panels get data
            slo = {"x-llm-d-slo-ttft-ms": "60000", **({"x-sightline-slo-e2e-ms": "0.001"} if i % 2 else {})}
            r = await client.post("/v1/completions", json={"prompt": f"Request {i}:", "max_tokens": 12}, headers=slo)
            return r.status_code

        async def streamed(i: int, walk_away: bool = False) -> int:
            # a walked-away-from request is held: still running when its client goes
            body = {
                "messages": [{"role": "user", "content": f"Say {i}"}],
                "stream": True,
                "max_tokens": 16,
                "stream_options": {"include_usage": True},
                **(HOLD if walk_away else {}),
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if walk_away and chunks >= 3:
                        break  # the connection closes: the server aborts the request
                return r.status_code

        async def invalid(i: int) -> int:
            return (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})).status_code

        async def embed(i: int) -> int:  # the server pools (--pooling last): the embeddings panels get data
            r = await client.post("/v1/embeddings", json={"input": [f"Embed {i}", f"and {i} more"]})
            return r.status_code

        async def structured(i: int) -> int:  # a schema of its own: a compile (a miss); asked twice: a hit
            schema = {"type": "object", "properties": {f"k{i % 4}": {"enum": ["a", "b"]}}, "required": [f"k{i % 4}"]}
            r = await client.post(
                "/v1/completions",
                json={
                    "prompt": "JSON:",
                    "max_tokens": 16,
                    "structured_outputs": {"json": schema, "disable_any_whitespace": True},
                },
            )
            return r.status_code

        async def broken_call() -> int:  # a regex forces half a tool call: the tool-call parser fails on it
            half = '<tool_call>\n{"name": "f", "arguments": {'
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Call f."}],
                    "max_tokens": 24,
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "structured_outputs": {"regex": half.replace("{", r"\{")},
                },
            )
            return r.status_code

        async def one(job):
            async with gate:
                return await job

        # embeddings and grammar compiles first and last: their histograms need observations in more than one scrape
        jobs = [embed(i) for i in range(3)] + [structured(i) for i in range(3)]
        jobs += [plain(i) for i in range(16)] + [streamed(i) for i in range(16)]
        jobs += [streamed(i, walk_away=True) for i in range(6)] + [invalid(i) for i in range(2)]
        jobs += [embed(i) for i in range(3, 6)] + [structured(i) for i in range(3, 6)] + [broken_call()]
        return await asyncio.gather(*(one(j) for j in jobs))


def _send_undecodable_frame(runtime_dir: Path) -> None:
    push_frames(runtime_dir, "scheduler", b"\x93not-a-message")


def _while_engine_stalled(server, action):
    """Run `action()` with the Scheduler SIGSTOPped and a stream in flight (sent once the engine
    stopped: no token can come); SIGCONT after, and the stream then runs to its end."""
    import os
    import signal
    import threading

    import httpx

    from tests.server_util import sse_events

    server.wait_held(0)  # the walked-away-from requests are gone: a held one would not count as stuck
    got: dict = {}

    def stream() -> None:
        body = {
            "prompt": "Stall here",
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            got["status"], got["events"] = r.status_code, sse_events(r.iter_lines())

    pid = server.debug()["pids"]["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    reader = threading.Thread(target=stream, daemon=True)
    try:
        reader.start()
        wait_until(lambda: server.debug()["in_flight"] == 1, 10, "the stream in flight")
        result = action()
    finally:
        os.kill(pid, signal.SIGCONT)
        reader.join(30)
    assert got["status"] == 200 and got["events"][-1] == "[DONE]", got
    assert got["events"][-2]["usage"]["completion_tokens"] == 8, got
    return result


def _deadline_and_burst(server, pool) -> list:
    """With the engine stopped: a request with a 0.3 s deadline ends with 504, and of BURST
    requests QUEUE - 1 wait for the engine (their futures are returned; the stalled stream holds
    the queue's last place) while the rest get 429."""
    r = server.post(
        "/v1/completions", {"prompt": "Too slow", "max_tokens": 8}, headers={"x-request-timeout": "0.3"}, timeout=30
    )
    assert r.status_code == 504, r.text
    burst = [
        pool.submit(server.post, "/v1/completions", {"prompt": f"Burst {i}", "max_tokens": 4}) for i in range(BURST)
    ]
    wait_until(lambda: sum(f.done() for f in burst) >= BURST - (QUEUE - 1), 20, "the burst's overflow shed")
    shed = [f.result() for f in burst if f.done()]
    assert [r.status_code for r in shed] == [429] * (BURST - (QUEUE - 1)), [r.text for r in shed]
    assert all(int(r.headers["retry-after"]) >= 1 for r in shed)
    return burst


def test_live_stack_every_query_has_data_and_stalls_and_failures_page(tmp_path):
    """A real server under load, scraped by a real Prometheus: a stalled engine pages (and,
    while it is stopped, a deadline ends a request with 504 and a burst is shed with 429), a
    killed engine process pages and is restarted, every dashboard query and every recording
    rule returns data, and every metric name exists."""
    import asyncio
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.helpers import boards, exprs
    from tests.prom_util import Prometheus, exposed_names
    from tests.server_util import ServerProc

    require_tool("prometheus"), require_tool("prometheus-alertmanager")
    t0 = time.monotonic()
    # the watchdog must not restart the stopped engine; the burst must overflow the queue
    server = ServerProc(
        "--peak-probe",
        "--watchdog-timeout",
        "120",
        "--max-queued-requests",
        str(QUEUE),
        "--pooling",
        "last",
        tmpdir=tmp_path,
    )
    got: list[dict] = []
    pool = ThreadPoolExecutor(BURST)

    def paged(alertname: str) -> list[dict]:
        return [a for a in got if a["alertname"] == alertname and a["status"] == "firing"]

    def stall_paged() -> list[dict]:
        return paged("SightlineEngineStalled")

    def while_stalled():
        burst = _deadline_and_burst(server, pool)
        return burst, prom.wait_for("SightlineEngineStalled at the webhook", stall_paged, 40)

    try:
        generate.write(tmp_path, generate.rule_outputs(slo.load(overrides=LIVE_RULES)))
        with (
            WebhookLog(got.append) as hook,
            Alertmanager(tmp_path, local_alertmanager_config(tmp_path / "am.yml", hook.port)) as am,
        ):
            prom_config = local_prometheus_config(
                tmp_path / "prom.yml",
                tmp_path / generate.RULES_DIR,
                [f"127.0.0.1:{server.port}"],
                f"127.0.0.1:{am.port}",
            )
            with Prometheus(tmp_path, prom_config) as prom:
                start = time.time()
                prom.wait_for(
                    "sightline scraped", lambda: prom.api("query", query='up{job="sightline"} == 1')["result"], 30
                )
                statuses = asyncio.run(_load(server.url))
                assert statuses == [200] * 44 + [400] * 2 + [200] * 7, statuses
                _send_undecodable_frame(server.runtime_dir)
                assert not stall_paged(), "the engine counted as stalled before it was stopped"
                burst, fired = _while_engine_stalled(server, while_stalled)
                assert {a["receiver"] for a in fired} == {"page"}, fired
                assert [f.result(60).status_code for f in burst].count(200) == QUEUE - 1  # served after SIGCONT

                os.kill(server.debug()["pids"]["detokenizer"], signal.SIGKILL)
                failed = prom.wait_for(
                    "SightlineEngineRestarting at the webhook", lambda: paged("SightlineEngineRestarting"), 30
                )
                assert {(a["receiver"], a["labels"]["role"], a["labels"]["cause"]) for a in failed} == {
                    ("page", "detokenizer", "exited")
                }, failed
                server.wait_healthy(60)  # the engine was restarted, HTTP stayed up
                assert '"msg": "engine failure: detokenizer exited' in server.log()
                for _ in range(2):  # a few scrapes with the engine running again
                    prom.scraped_after(time.time())
                # the query range's last point (2 s steps from `start`) is `end` itself; then Prometheus
                # holds everything up to `end`
                end = math.ceil(time.time())
                start = end - 2 * math.ceil((end - start) / 2)
                prom.scraped_after(end, evaluated=True)
                missing, evaluated = queries_without_data(prom, start, end)
                assert missing == [], "no data for:\n" + "\n".join(missing)
                exemplars = prom.api(
                    "query_exemplars", query="sightline_time_to_first_token_seconds_bucket", start=start, end=end
                )
        print(
            f"live: {evaluated} panel queries and recording rules returned data; alerts delivered: "
            f"{sorted({(a['alertname'], a['receiver']) for a in got})}"
        )
        trace_ids = [e["labels"].get("trace_id", "") for s in exemplars for e in s["exemplars"]]
        assert trace_ids and all(re.fullmatch(r"[0-9a-f]{32}", t) for t in trace_ids), exemplars

        names = exposed_names(httpx.get(server.url + "/metrics", timeout=10).text)
        used = {m for b in boards().values() for e in exprs(b) for m in lint_names(e)}
        used |= {m for f in rule_files().values() for _, e in rule_exprs(f) for m in lint_names(e)}
        assert {m for m in used if ":" not in m} - names - {"up", "ALERTS"} == set()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        server.stop()
    assert time.monotonic() - t0 < 120
