"""Tenants on a real server: keys with roles, prefix-cache isolation against a probe, per-tenant
limits and usage that add up, keys reloaded under live streams, a limit held across workers."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_util import HOLD, ServerProc, samples, scrape, sse_events, value, wait_until

ADMIN = "sk-admin-0123456789abcdef"  # --api-key: tenant default, admin
KEY_A, KEY_B, KEY_C = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789", "sk-tenant-c-0123456789"
KEYS = f"""
[tenants.a]
max_concurrent_requests = 2

[[keys]]
tenant = "a"
key = "{KEY_A}"

[[keys]]
tenant = "b"
key = "{KEY_B}"
"""
RECORD = "Patient record. Diagnosis: acute lymphoblastic leukemia, stage two, confidential."
GUESSES = [
    "Patient record. Diagnosis: " + d + ", stage two, confidential."
    for d in (
        "seasonal influenza",
        "acute lymphoblastic leukemia",
        "type two diabetes",
        "broken left wrist",
        "mild asthma",
    )
]
HITS = "sightline_prefix_cache_hits_tokens_total"


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def write_keys(path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    write_keys(path, KEYS)
    return path


@pytest.fixture(scope="module")
def srv(tmp_path_factory, keys_file):
    s = ServerProc(
        "--api-keys-file", str(keys_file), tmpdir=tmp_path_factory.mktemp("tenants"), env={"SIGHTLINE_API_KEY": ADMIN}
    )
    try:
        yield s
    finally:
        s.stop()


def complete(srv, key: str, prompt: str, **extra) -> httpx.Response:
    return srv.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}, headers=auth(key)
    )


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def probe(srv, victim: str, attacker: str, victim_extra: dict, attacker_extra: dict) -> tuple[list[int], float]:
    """The victim's record, then the attacker's format warm-up and guesses: (cached tokens per guess, prefix-cache
    hits the guesses made)."""
    assert srv.post("/flush_cache", b"", headers=auth(ADMIN)).status_code == 200
    cached(complete(srv, victim, RECORD, **victim_extra))
    cached(complete(srv, attacker, "Patient record. Diagnosis: unknown.", **attacker_extra))  # the format, warmed
    before = value(scrape(srv), HITS)
    seen = [cached(complete(srv, attacker, g, **attacker_extra)) for g in GUESSES]
    srv.barrier()  # the engine's stats of every guess are in
    return seen, value(scrape(srv), HITS) - before


def test_another_tenants_prompt_cannot_be_probed(srv):
    seen, hits = probe(srv, KEY_A, KEY_B, {}, {})
    assert len(set(seen)) == 1, seen  # the right guess (the second) looks like every wrong one
    assert hits == sum(seen)  # the engine reused only the attacker's own warm-up, never the record
    # the same probe inside one tenant does see the record: the probe can tell (the cache is shared there)
    same, _ = probe(srv, KEY_A, KEY_A, {}, {})
    assert same[1] > max(same[0], *same[2:]), same


def test_cache_salt_isolates_inside_a_tenant(srv):
    seen, hits = probe(srv, KEY_A, KEY_A, {"cache_salt": "user-1"}, {"cache_salt": "user-2"})
    assert len(set(seen)) == 1 and hits == sum(seen), seen
    salted, _ = probe(srv, KEY_A, KEY_A, {"cache_salt": "user-1"}, {"cache_salt": "user-1"})
    assert salted[1] > max(salted[0], *salted[2:]), salted
    r = srv.post(
        "/generate", {"text": RECORD, "cache_salt": "", "sampling_params": {"max_new_tokens": 1}}, headers=auth(KEY_A)
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_only_an_admin_key_opens_debug_flush_and_control(srv):
    for path, method in (
        ("/debug/state", "GET"),
        ("/debug/requests", "GET"),
        ("/flush_cache", "POST"),
        ("/pause_generation", "POST"),
        ("/control/config", "GET"),
    ):
        r = httpx.request(
            method,
            srv.url + path,
            headers={**auth(KEY_B), "content-type": "application/json"},
            content=b'{"mode": "drain"}' if path == "/pause_generation" else None,
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", (path, r.text)
        assert httpx.request(method, srv.url + path).status_code == 401, path
    assert httpx.get(srv.url + "/debug/state", headers=auth(ADMIN)).status_code == 200
    assert httpx.get(srv.url + "/v1/models", headers=auth(KEY_B)).status_code == 200
    r = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "guided_json": {}}, headers=auth(KEY_B))
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    assert KEY_A not in srv.log() and KEY_B not in srv.log()


class Streamer(threading.Thread):
    """One streaming completion in the background: its status, the arrival time of each text chunk and its
    final usage.  A held one (the hold seam) stops one token short until `ServerProc.release`."""

    def __init__(self, srv, key: str, tokens: int, hold: bool = False) -> None:
        super().__init__(daemon=True)
        self.srv, self.key, self.tokens, self.hold = srv, key, tokens, hold
        self.status, self.times, self.done, self.completion_tokens = None, [], False, None
        self.start()

    def run(self) -> None:
        body = {
            "prompt": "Tell me a story.",
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(HOLD if self.hold else {}),
        }
        with httpx.stream(
            "POST", self.srv.url + "/v1/completions", json=body, headers=auth(self.key), timeout=120
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                for ev in sse_events([line]):
                    self.done = ev == "[DONE]"
                    if isinstance(ev, dict) and ev["choices"]:
                        self.times.append(time.monotonic())
                    elif isinstance(ev, dict) and ev.get("usage"):
                        self.completion_tokens = ev["usage"]["completion_tokens"]

    def itl(self) -> float:
        gaps = [b - a for a, b in zip(self.times[1:-1], self.times[2:])]  # the first chunk's prefill left out
        return statistics.median(gaps)


def test_a_tenant_at_its_limit_gets_429_and_the_other_keeps_its_pace(srv):
    alone = Streamer(srv, KEY_B, 60)
    alone.join(60)
    hogs = [Streamer(srv, KEY_A, 8, hold=True) for _ in range(2)]
    srv.wait_held(2)  # tenant a's two streams run (held) until released
    shed = value(scrape(srv), "sightline_tenant_requests_total", tenant="a", outcome="shed")
    b = Streamer(srv, KEY_B, 60)
    refused = [complete(srv, KEY_A, "one more") for _ in range(10)]
    assert srv.debug()["tenants"]["a"]["in_flight"] == 2
    assert value(scrape(srv), "sightline_tenant_requests_total", tenant="a", outcome="shed") - shed == 10
    for r in refused:
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_concurrency", r.text
        assert int(r.headers["retry-after"]) >= 1 and "limit is 2" in r.json()["error"]["message"]
    b.join(60)
    assert b.status == 200 and b.done and b.completion_tokens == 60
    assert not any(h.done for h in hogs) and srv.held() == 2
    srv.release()
    for h in hogs:
        h.join(60)
    assert all(h.status == 200 and h.done and h.completion_tokens == 8 for h in hogs)
    assert b.itl() < 3 * alone.itl() + 0.02, (alone.itl(), b.itl())  # none of the ten refused joined its batch
    assert cached(complete(srv, KEY_A, "now there is room")) >= 0


def test_per_tenant_counters_sum_to_the_totals(srv):
    before = scrape(srv)
    a_statuses: list[int] = []

    def count_me(key: str, prompt: str) -> None:
        r = complete(srv, key, prompt, max_tokens=5)
        if key == KEY_A:
            a_statuses.append(r.status_code)

    threads = [
        threading.Thread(target=count_me, args=(key, f"count me {i}"))
        for i in range(6)
        for key in (KEY_A, KEY_B, ADMIN)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    srv.barrier()  # the engine's token counts of every request are in
    text = scrape(srv)
    for tenant_metric, total in (
        ("sightline_tenant_prompt_tokens_total", "sightline_prompt_tokens_total"),
        ("sightline_tenant_generation_tokens_total", "sightline_generation_tokens_total"),
    ):
        assert value(text, tenant_metric) == value(text, total) > 0, tenant_metric
    assert value(text, "sightline_tenant_requests_total") == value(text, "sightline_requests_total")
    for outcome in ("stop", "length", "shed", "rejected"):
        assert value(text, "sightline_tenant_requests_total", outcome=outcome) == value(
            text, "sightline_requests_total", outcome=outcome
        ), outcome
    shed = value(text, "sightline_tenant_requests_total", tenant="a", outcome="shed") - value(
        before, "sightline_tenant_requests_total", tenant="a", outcome="shed"
    )
    assert shed == a_statuses.count(429)  # a's six at once, two at a time: what did not fit was shed
    tenants = {
        s.labels["tenant"] for s in samples(text) if s.name == "sightline_tenant_cpu_seconds_total" and s.value > 0
    }
    assert {"a", "b", "default"} <= tenants
    assert value(text, "sightline_tenant_cpu_seconds_total") <= value(
        text, "sightline_process_cpu_seconds_total", role="scheduler"
    )
    assert value(text, "sightline_tenant_cached_tokens_total") > 0


def test_keys_reload_without_dropping_streams(srv, keys_file):
    live = Streamer(srv, KEY_B, 16, hold=True)
    srv.wait_held(1)  # it runs across both reloads
    write_keys(keys_file, KEYS.replace(KEY_B, KEY_C))  # b's key replaced by c: noticed by the file watch
    wait_until(lambda: complete(srv, KEY_C, "hi").status_code == 200, 10, "the new key")
    assert complete(srv, KEY_B, "hi").status_code == 401
    write_keys(keys_file, KEYS)
    os.kill(srv.proc.pid, signal.SIGHUP)
    wait_until(lambda: complete(srv, KEY_B, "hi").status_code == 200, 10, "the key back after SIGHUP")
    assert not live.done and srv.held() == 1
    srv.release()
    live.join(60)
    assert live.status == 200 and live.done and live.completion_tokens == 16  # the stream never noticed
    failed = value(scrape(srv), "sightline_api_key_reloads_total", result="failed")
    write_keys(keys_file, "not toml [")  # a broken file: the keys in force stay
    wait_until(
        lambda: value(scrape(srv), "sightline_api_key_reloads_total", result="failed") == failed + 1,
        10,
        "the broken file's failed reload",
    )
    assert complete(srv, KEY_B, "hi").status_code == 200
    write_keys(keys_file, KEYS)
    assert KEY_C not in srv.log()


def test_a_keys_file_others_can_read_stops_the_start(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    path.chmod(0o644)
    out = subprocess.run(
        [sys.executable, "-m", "serving", "serve", "--model", "tiny-random", "--api-keys-file", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "readable by group or others" in out.stderr and KEY_A not in out.stderr


def test_a_limit_holds_across_tokenizer_workers(tmp_path, keys_file):
    s = ServerProc(
        "--api-keys-file",
        str(keys_file),
        "--tokenizer-worker-num",
        "2",
        tmpdir=tmp_path,
        env={"SIGHTLINE_API_KEY": ADMIN},
    )
    try:
        hogs = [Streamer(s, KEY_A, 8, hold=True) for _ in range(2)]
        s.wait_held(2)  # tenant a's two streams run until released
        statuses = [complete(s, KEY_A, f"more {i}").status_code for i in range(8)]  # new connections: both workers
        assert statuses == [429] * 8, statuses  # 2 in flight in all, not 2 per worker
        assert complete(s, KEY_B, "b is not limited").status_code == 200
        s.release()
        for h in hogs:
            h.join(60)
        assert all(h.status == 200 and h.done and h.completion_tokens == 8 for h in hogs)
        assert complete(s, KEY_A, "room again").status_code == 200
    finally:
        s.stop()
