"""Locust users for sightline's streaming API; run through `python -m loadtest` (it writes the plan).

Locust's own timing of a streamed response stops at the headers, so these users use a
plain `requests` session (no automatic Locust event), read the SSE stream themselves
and fire one custom event per measurement, under request types TTFT, ITL (one per
gap), TPOT, E2E (failures carry their reason), TOKENS (response_time = output
tokens) and CACHED (response_time = prompt tokens the server's prefix cache served,
from `usage.prompt_tokens_details.cached_tokens`; only when the server reports it),
named after the workload.  Every request asks for the usage chunk
(`stream_options.include_usage`, set by `build_request`) and is appended to
`records.jsonl` (token counts and cached tokens included) for exact percentiles.
Arrival modes: `ClosedLoopUser` (N users, one request at a time each) and
`PoissonArrivals` (one user spawning requests at exponential intervals: open loop).
`StageShape` holds each load level for `stage_seconds`.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from pathlib import Path

import gevent
import requests
from gevent import GreenletExit
from gevent.pool import Pool
from locust import LoadTestShape, User, constant, events, task
from locust.env import Environment
from locust.stats import CSV_STATS_INTERVAL_SEC

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.config import Plan  # noqa: E402
from loadtest.records import RequestRecord  # noqa: E402
from loadtest.server import auth_headers  # noqa: E402
from loadtest.sse import StreamReader  # noqa: E402
from loadtest.workloads import build_request, pick_workload  # noqa: E402

PLAN_ENV = "SIGHTLINE_LOADTEST_PLAN"
if PLAN_ENV not in os.environ:
    raise SystemExit(f"{PLAN_ENV} is not set: run this suite with `python -m loadtest` (docs/loadtest.md)")
PLAN = Plan.from_json(Path(os.environ[PLAN_ENV]).read_text())
LEVELS = PLAN.scenario.shape.levels
_records = open(PLAN.records_path, "a", buffering=1)
_user_ids = itertools.count()
CLIENT_CLOSED = 499  # the status the server counts for a request whose client went away


class RequestFailed(Exception):
    """Carries the failure reason into Locust's failures table."""


class StageShape(LoadTestShape):
    """Each level of the scenario's shape for stage_seconds, then stop."""

    def stage_index(self) -> int:
        return min(int(self.get_run_time() // PLAN.scenario.shape.stage_seconds), len(LEVELS) - 1)

    def tick(self) -> tuple[int, float] | None:
        if self.get_run_time() >= PLAN.scenario.shape.duration:
            return None
        users = int(LEVELS[self.stage_index()]) if PLAN.scenario.arrival == "closed" else 1
        return users, 100.0  # spawn a stage's users within a fraction of a second


def _session(connections: int) -> requests.Session:
    s = requests.Session()
    s.headers.update(auth_headers())
    s.mount("http://", requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=connections))
    return s


def _http_reason(resp: requests.Response) -> str:
    try:
        err = resp.json()["error"]
        detail = err.get("code") or err.get("type") or ""
    except (ValueError, KeyError, TypeError, AttributeError):
        detail = ""
    return f"http {resp.status_code} {detail}".strip()


def _read(session: requests.Session, url: str, body: dict, reader: StreamReader) -> None:
    with session.post(url, json=body, stream=True, timeout=(10, None)) as resp:
        reader.rec.status = resp.status_code
        if resp.status_code != 200:
            reader.rec.error, reader.rec.finish_reason = _http_reason(resp), "error"
            return
        for chunk in resp.iter_content(chunk_size=None):
            reader.feed(chunk, time.perf_counter())


def run_request(env: Environment, session: requests.Session, rng: random.Random) -> RequestRecord:
    """Send one request of a workload drawn from the mix, read its stream, report it."""
    w = pick_workload(PLAN, rng)
    path, body = build_request(w, PLAN, rng)
    stage = env.shape_class.stage_index()
    rec = RequestRecord(w.name, w.endpoint, stage, LEVELS[stage], time.time(), 0.0)
    reader = StreamReader(rec, time.perf_counter())
    timer = gevent.Timeout(w.timeout_s)
    timer.start()
    try:
        _read(session, PLAN.url + path, body, reader)
    except gevent.Timeout as exc:
        if exc is not timer:
            raise
        rec.error, rec.status = f"timeout after {w.timeout_s:g} s", CLIENT_CLOSED
    except GreenletExit:
        rec.error, rec.status = "stopped by locust before the end", CLIENT_CLOSED
        report(env, reader.finish(time.perf_counter()))
        raise
    except requests.RequestException as exc:
        rec.error = f"{'broken stream' if rec.status else 'connection error'}: {type(exc).__name__}"
    finally:
        timer.close()
    report(env, reader.finish(time.perf_counter()))
    return rec


def _fire(env: Environment, kind: str, rec: RequestRecord, value: float, length: int = 0,
          failure: str | None = None) -> None:
    env.events.request.fire(request_type=kind, name=rec.workload, response_time=value, response_length=length,
                            exception=RequestFailed(failure) if failure else None, context={})


def report(env: Environment, rec: RequestRecord) -> None:
    """Custom Locust events (ms; TOKENS in tokens) and one line in records.jsonl."""
    if not rec.ok:
        _fire(env, "E2E", rec, rec.e2e * 1000, failure=rec.error)
    else:
        n = rec.output_tokens
        _fire(env, "E2E", rec, rec.e2e * 1000, length=n)
        _fire(env, "TTFT", rec, rec.ttft * 1000)
        if rec.tpot is not None:
            _fire(env, "TPOT", rec, rec.tpot * 1000)
        for gap in rec.itl:
            _fire(env, "ITL", rec, gap * 1000)
        _fire(env, "TOKENS", rec, n, length=n)
        if rec.cached_tokens is not None:
            _fire(env, "CACHED", rec, rec.cached_tokens, length=rec.cached_tokens)
    _records.write(rec.to_json() + "\n")


@events.quitting.add_listener
def _last_csv_write(environment: Environment, **_kw) -> None:
    """Locust's CSV writer wakes once a second and gets no last call at shutdown, so the requests
    that finished in the final second (in a closed loop, often all the last ones) would be
    missing from the CSV: give it one more turn."""
    _records.close()
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


class ClosedLoopUser(User):
    """Closed loop: each user sends its next request when the last one ends (offered load = users)."""

    abstract = PLAN.scenario.arrival != "closed"
    wait_time = constant(0)

    def on_start(self) -> None:
        self.session = _session(1)
        self.rng = random.Random(PLAN.seed * 1_000_003 + next(_user_ids))

    @task
    def one_request(self) -> None:
        if not run_request(self.environment, self.session, self.rng).ok:
            gevent.sleep(PLAN.failure_backoff_s)  # a 503 comes back in milliseconds: no hot loop


class PoissonArrivals(User):
    """Open loop: requests arrive at exponential intervals at the stage's rate, whatever is in flight."""

    abstract = PLAN.scenario.arrival != "poisson"
    wait_time = constant(0)

    def on_start(self) -> None:
        self.session = _session(PLAN.max_in_flight)
        self.pool = Pool(PLAN.max_in_flight)  # spawn() blocks at this many open requests
        self.rng = random.Random(PLAN.seed * 1_000_003 + next(_user_ids))

    @task
    def arrive(self) -> None:
        gevent.sleep(self.rng.expovariate(LEVELS[self.environment.shape_class.stage_index()]))
        self.pool.spawn(run_request, self.environment, self.session, random.Random(self.rng.random()))

    def on_stop(self) -> None:
        self.pool.join()  # let open requests finish (Locust's --stop-timeout bounds this)
