"""GET /debug/ui in a real headless Chromium: a real streamed request's waterfall across the three
processes with a stale drop marked, the API key taken from the URL fragment; and the in-flight list.

Chromium is the Debian package (`make setup` installs it when run as root). Missing, the test
skips loudly, except under CI=true, where it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from protocol.io_struct import BatchStrOutput, ReqMeta, StrOut
from tests.server_util import HOLD, TEST_KEY, push, sse_events, wait_until

KEY = TEST_KEY
AUTH = {"authorization": f"Bearer {KEY}"}
RESULTS = Path(__file__).resolve().parents[2] / "results"


def chromium() -> str:
    path = shutil.which("chromium")
    if path:
        return path
    message = "`chromium` is not on PATH: apt-get install chromium (`make setup` does it when run as root)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {message}")
    pytest.skip(f"!!! SKIPPED, NOT TESTED !!! {message}")


def headless(browser: str, tmp: Path, url: str, *args: str) -> str:
    cmd = [
        browser,
        "--headless",
        "--disable-gpu",
        "--no-sandbox",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        "--virtual-time-budget=3000",
        *args,
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Rows(HTMLParser):
    """The waterfall's rows (`div.row` with data-* attributes) and the text of elements by id."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div" and a.get("class") == "row":
            self.rows.append(a)
        self._open.append(a.get("id"))
        if a.get("id"):
            self.text[a["id"]] = ""

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for i in self._open:
            if i:
                self.text[i] += data


@pytest.fixture
def server(keyed_server):
    return keyed_server


def test_in_flight_requests_are_listed(server):
    body = {"model": "tiny-random", "prompt": "a long story", "max_tokens": 8, "stream": True, **HOLD}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        rid = r.headers["x-request-id"]  # held open: leaving the block disconnects
        server.wait_held(1)  # it has streamed 7 tokens and runs on
        listed = httpx.get(server.url + "/debug/requests", params={"in_flight": 1}, headers=AUTH).json()["requests"]
    mine = [x for x in listed if x["rid"] == rid]
    assert mine and mine[0]["state"] == "running" and mine[0]["route"] == "/v1/completions", listed
    assert mine[0]["completion_tokens"] == 7 and mine[0]["age_ms"] > 0 and mine[0]["stream"] is True
    wait_until(lambda: server.held() == 0, 10, "the held request cut by its client")


def test_inspector_page_draws_a_streamed_request(server, tmp_path):
    browser = chromium()
    page = httpx.get(server.url + "/debug/ui")  # the static page needs no key; its data does
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in page.headers["content-security-policy"] and "<script>" in page.text
    assert httpx.get(server.url + "/debug/requests").status_code == 401

    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "<b>hi</b>"}],
            "max_tokens": 12,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        rid, traceparent = r.headers["x-request-id"], r.headers["traceparent"]
        assert sse_events(r.iter_lines())[-1] == "[DONE]"
    # a late output for the finished rid, as a slow Detokenizer would send it: dropped, and marked
    push(
        server,
        "tm-detok",
        BatchStrOutput(
            outputs=[StrOut(rid=rid, text="late", output_ids=[1], meta=ReqMeta(trace={"traceparent": traceparent}))]
        ),
    )

    def complete():
        entry = httpx.get(f"{server.url}/debug/requests/{rid}", headers=AUTH).json()
        roles = {s["role"] for s in entry.get("spans", [])}
        names = {s["name"] for s in entry.get("spans", [])}
        server_span = any(s["kind"] == "SERVER" for s in entry.get("spans", []))
        return (
            entry
            if {"main", "scheduler", "detokenizer"} <= roles and "stale_message_dropped" in names and server_span
            else None
        )

    server.barrier()  # the children's spans (they come with their stats) are in
    entry = wait_until(complete, 15, "the server span and the stale drop of the late output")

    dom = headless(browser, tmp_path, f"{server.url}/debug/ui#key={KEY}&rid={rid}", "--dump-dom")
    parsed = Rows()
    parsed.feed(dom)
    assert parsed.text.get("status", "").startswith("updated"), parsed.text.get("status")
    assert parsed.text["detail-rid"] == rid
    assert rid in parsed.text["recent"]
    spans = [row for row in parsed.rows if row.get("data-source") == "span"]
    assert len(spans) == len(entry["spans"])  # one row each
    assert {"main", "scheduler", "detokenizer"} <= {row["data-lane"] for row in spans}
    assert {"tokenize", "queue", "decode", "detokenize", "stream"} <= {row["data-name"] for row in spans}
    stale = [row for row in spans if row["data-stale"] == "1"]
    assert stale and stale[0]["data-name"] == "stale_message_dropped" and stale[0]["data-lane"] == "stale"
    assert KEY not in dom  # the key left the address bar for sessionStorage

    shot = tmp_path / "inspector.png"
    headless(
        browser,
        tmp_path,
        f"{server.url}/debug/ui#key={KEY}&rid={rid}",
        f"--screenshot={shot}",
        "--window-size=1400,900",
        "--hide-scrollbars",
    )
    assert shot.exists() and shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    RESULTS.mkdir(exist_ok=True)
    shutil.copy(shot, RESULTS / "inspector.png")
