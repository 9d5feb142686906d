"""Locust users for sightline's streaming API, under plain Locust or `python -m loadtest`.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000             # web UI on :8089
    locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 1m --host http://127.0.0.1:8000 \
        --workload chat --slo-ttft 1000 --slo-tpot 100

Plain Locust: closed-loop users (`-u`) of `--workload` (a name, or a mix `chat=3,fixed=1`,
from loadtest/workloads.yaml), model `--model` or the one the server's /v1/models names,
goodput thresholds `--slo-ttft`/`--slo-tpot`/`--slo-e2e` (ms) and `--slo-objective` whose
defaults come from dashboards/slo.yaml (via loadtest/config.py).  At the end it prints the
fraction of requests within the SLO, and exits with `--exit-code-on-error` when that fraction
is under the objective (0 when it holds, even though single misses show as GOODPUT failures).
`python -m loadtest` passes a resolved plan instead (`--plan FILE`, or the fallback
SIGHTLINE_LOADTEST_PLAN): its scenario's arrival mode and `StageShape` then drive the run.

Locust's own timing of a streamed response stops at the headers, so these users use a
plain `requests` session (no automatic Locust event), read the SSE stream themselves
and fire one custom event per measurement, under request types TTFT, ITL (one per
gap), TPOT, E2E (failures carry their reason), TOKENS (response_time = output
tokens) and CACHED (response_time = prompt tokens the server's prefix cache served,
from `usage.prompt_tokens_details.cached_tokens`; only when the server reports it),
named after the workload.  Every request asks for the usage chunk
(`stream_options.include_usage`, set by `build_request`) and is appended to
`records.jsonl` (token counts and cached tokens included) for exact percentiles; under
plain Locust only with `--records FILE`.  One more row, GOODPUT, has one event per
successful request, a failure when it missed a goodput threshold ("ttft > 1000 ms"): its
failure ratio is the share of requests out of the SLO.
Arrival modes: `ClosedLoopUser` (N users, one request at a time each),
`PoissonArrivals` (one user spawning requests at exponential intervals: open loop; plan
runs only) and `ReplayUser` (a recorded dump's requests at their recorded offsets:
`python -m loadtest --replay DIR`, loadtest/replay/).  `StageShape` holds each load
level for `stage_seconds` (plan runs only; a replay: until every request has ended).
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO

import gevent
import gevent.event
import httpx
import requests
from gevent import GreenletExit
from gevent.pool import Pool
from locust import LoadTestShape, User, constant, events, task
from locust import log as locust_log
from locust.env import Environment
from locust.stats import CSV_STATS_INTERVAL_SEC
from locust.user.task import LOCUST_STATE_STOPPING

from loadtest.config import DEFAULT_CONFIG, Config, ConfigError, Plan, Scenario, Shape, Workload, parse_mix
from loadtest.records import RequestRecord
from loadtest.replay.readers import reader_class, sent_line
from loadtest.replay.schedule import SCHEDULE_FILE, SENT_FILE, ReplayItem, ReplayQueue
from loadtest.server import auth_headers, facts
from loadtest.sse import EmbeddingReader, StreamReader
from loadtest.stats import GOODPUT_KEYS, meets
from loadtest.workloads import build_request, pick_workload
from telemetry.request_slo import objective_headers

PLAN_ENV = "SIGHTLINE_LOADTEST_PLAN"
CLIENT_CLOSED = 499  # the status the server counts for a request whose client went away
log = logging.getLogger("loadtest")

# Set at init (a plan run) or at each test start (plain Locust: the host, users and custom
# arguments may change between runs in the web UI); read by the users and the shape.
PLAN: Plan | None = None
PLAN_MODE = False  # True when python -m loadtest passed a plan file
_records: IO[str] | None = None
_slo = Counter()  # plain Locust: requests, good (within every goodput threshold)
_replay: ReplayQueue | None = None  # a replay: its schedule (replay_schedule.jsonl beside the plan)
_replay_sent: IO[str] | None = None  # ... and what was sent (replay_sent.jsonl)
_replay_started = gevent.event.Event()
_user_ids = itertools.count()


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    """Locust's own custom arguments, so they are set the Locust way (command line, locust.conf,
    the web UI's form) with the SLO spec's thresholds as defaults.  Added on the parser itself,
    not a group: only its add_argument knows include_in_web_ui."""
    config = Config.load()
    parser.add_argument(
        "--workload",
        default="chat",
        help=f"workload from the workloads YAML, or a mix chat=3,fixed=1 ({', '.join(config.workloads)})",
    )
    parser.add_argument("--model", default="", help="model name in requests [the one the server's /v1/models names]")
    parser.add_argument(
        "--slo-ttft",
        type=float,
        default=config.goodput.get("ttft_ms", 0.0),
        help="goodput: TTFT threshold, ms (0: none) [dashboards/slo.yaml]",
    )
    parser.add_argument(
        "--slo-tpot",
        type=float,
        default=config.goodput.get("tpot_ms", 0.0),
        help="goodput: TPOT threshold, ms (0: none) [dashboards/slo.yaml]",
    )
    parser.add_argument(
        "--slo-e2e",
        type=float,
        default=config.goodput.get("e2e_ms", 0.0),
        help="goodput: end-to-end threshold, ms (0: none)",
    )
    parser.add_argument(
        "--slo-objective",
        type=float,
        default=config.objective,
        help="fraction of requests that must meet every threshold [dashboards/slo.yaml]",
    )
    parser.add_argument(
        "--records",
        default="",
        include_in_web_ui=False,
        help="append one JSON line per request to this file (records.jsonl)",
    )
    parser.add_argument(
        "--workloads-config",
        default=str(DEFAULT_CONFIG),
        include_in_web_ui=False,
        help="workloads YAML [loadtest/workloads.yaml]",
    )
    parser.add_argument("--seed", type=int, default=0, include_in_web_ui=False, help="seed of the request generators")
    parser.add_argument(
        "--failure-backoff",
        type=float,
        default=1.0,
        include_in_web_ui=False,
        help="seconds a user waits after a failed request [1]",
    )
    parser.add_argument(
        "--plan",
        default="",
        env_var=PLAN_ENV,
        include_in_web_ui=False,
        help="a resolved plan.json (what python -m loadtest passes); the options above then do nothing",
    )


@events.init.add_listener
def _init(environment: Environment, **_kw) -> None:
    """A plan run keeps its shape and the user class of its arrival mode; plain Locust runs
    closed-loop users at Locust's -u/-r/-t (no shape).  Bad arguments stop here, before any load."""
    global PLAN, PLAN_MODE
    o = environment.parsed_options
    PLAN_MODE = bool(o and o.plan)
    if PLAN_MODE:
        PLAN = Plan.from_json(Path(o.plan).read_text())
        keep = {"closed": ClosedLoopUser, "replay": ReplayUser}.get(PLAN.scenario.arrival, PoissonArrivals)
        if PLAN.scenario.arrival == "replay":
            _open_replay(Path(o.plan).parent)
        environment.stop_timeout = environment.stop_timeout or max(w.timeout_s for w in PLAN.workloads) + 10
    else:
        try:
            _check_plain_options(o)
        except ConfigError as exc:
            log.error("%s", exc)
            sys.exit(2)
        environment.shape_class = None
        keep = ClosedLoopUser
    environment.user_classes[:] = [keep]
    if environment.available_user_classes:
        for name in [n for n in environment.available_user_classes if n != keep.__name__]:
            environment.available_user_classes.pop(name)


def _open_replay(folder: Path) -> None:
    global _replay, _replay_sent
    _replay = ReplayQueue.load(folder / SCHEDULE_FILE)
    _replay_sent = open(folder / SENT_FILE, "a", buffering=1)


@events.spawning_complete.add_listener
def _spawned(user_count: int, **_kw) -> None:
    """A replay's clock starts once every user is there, so the first requests find a free one."""
    if _replay is not None:
        _replay.start(time.perf_counter())
        _replay_started.set()


def _check_plain_options(o) -> None:
    config = Config.load(Path(o.workloads_config))
    unknown = [w for w in parse_mix(o.workload) if w not in config.workloads]
    if unknown:
        raise ConfigError(
            f"--workload: no workload {', '.join(unknown)} in {o.workloads_config} "
            f"(have: {', '.join(config.workloads)})"
        )
    if not 0 < o.slo_objective <= 1 or min(o.slo_ttft, o.slo_tpot, o.slo_e2e) < 0:
        raise ConfigError("--slo-objective must be in (0, 1] and the --slo-* thresholds ≥ 0")


def plain_plan(environment: Environment) -> Plan:
    """The Plan of a plain Locust run, from its options (web UI form included) and the server."""
    o = environment.parsed_options
    _check_plain_options(o)
    if not environment.host:
        raise ConfigError("no host: give --host http://127.0.0.1:8000 (or fill the web UI's Host field)")
    config = Config.load(Path(o.workloads_config))
    url = environment.host.rstrip("/")
    mix = parse_mix(o.workload)
    needs_context = any(config.workloads[w].prompt_tokens == "context" for w in mix)
    served = facts(url) if needs_context or not o.model else None
    goodput = {key: float(v) for key, v in zip(GOODPUT_KEYS, (o.slo_ttft, o.slo_tpot, o.slo_e2e)) if v > 0}
    users = float(max(1, int(o.num_users or 1)))
    scenario = Scenario("locust", mix, "closed", Shape((users,), float(o.run_time or 3600)), {}, goodput)
    workloads = [config.workloads[w].resolve(served.max_model_len if served else None) for w in mix]
    return Plan(
        url, o.model or served.model, scenario, workloads, o.records, o.seed, failure_backoff_s=o.failure_backoff
    )


@events.test_start.add_listener
def _test_start(environment: Environment, **_kw) -> None:
    """Plain Locust: resolve the plan now (the web UI may have changed host, users or options);
    on a bad option or an unreachable server, say why and stop instead of sending anything."""
    global PLAN, _records
    if not PLAN_MODE:
        try:
            PLAN = plain_plan(environment)
        except (ConfigError, OSError, KeyError, IndexError, ValueError, httpx.HTTPError) as exc:
            PLAN = None
            log.error("cannot start against %s: %s", environment.host, exc)
            if environment.parsed_options.headless:
                environment.process_exit_code = 2
                gevent.spawn(environment.runner.quit)
            else:
                gevent.spawn(environment.runner.stop)
            return
        _slo.clear()
        slo = ", ".join(f"{k[:-3]} ≤ {v:g} ms" for k, v in PLAN.scenario.goodput.items()) or "none"
        log.info("sightline: %s against %s (model %s), goodput SLO %s", PLAN.scenario.mix, PLAN.url, PLAN.model, slo)
    if _records is not None:
        _records.close()
    _records = open(PLAN.records_path, "a", buffering=1) if PLAN.records_path else None


class RequestFailed(Exception):
    """Carries the failure reason into Locust's failures table."""


class StageShape(LoadTestShape):
    """Each level of the scenario's shape for stage_seconds, then stop (plan runs; plain Locust drops
    it at init).  `use_common_options` only keeps Locust from warning that -u/-r/-t are ignored."""

    use_common_options = True

    def stage_index(self) -> int:
        return min(int(self.get_run_time() // PLAN.scenario.shape.stage_seconds), len(PLAN.scenario.shape.levels) - 1)

    def tick(self) -> tuple[int, float] | None:
        if self.get_run_time() >= PLAN.scenario.shape.duration:
            return None
        if PLAN.scenario.arrival == "replay":  # one level (the users), until every request has ended
            users = int(PLAN.scenario.shape.levels[0])
            return None if _replay is None or _replay.finished else (users, float(max(100, users)))
        users = int(PLAN.scenario.shape.levels[self.stage_index()]) if PLAN.scenario.arrival == "closed" else 1
        return users, 100.0  # spawn a stage's users within a fraction of a second


def stage_and_level(env: Environment) -> tuple[int, float]:
    """The stage in effect and its offered load; under plain Locust, stage 0 at the current user count."""
    if isinstance(env.shape_class, StageShape):
        stage = env.shape_class.stage_index()
        return stage, PLAN.scenario.shape.levels[stage]
    return 0, float(getattr(env.runner, "target_user_count", None) or env.runner.user_count)


def _session(connections: int) -> requests.Session:
    """Every request carries the goodput thresholds as objective headers: the server counts its own goodput
    against the same numbers (SLOs → Server-side goodput)."""
    s = requests.Session()
    s.headers.update({**auth_headers(), **objective_headers(PLAN.scenario.goodput)})
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
        if on_response := getattr(reader, "on_response", None):  # a replay keeps the x-request-id
            on_response(resp)
        if resp.status_code != 200:
            reader.rec.error, reader.rec.finish_reason = _http_reason(resp), "error"
            return
        for chunk in resp.iter_content(chunk_size=None):
            reader.feed(chunk, time.perf_counter())


def run_request(env: Environment, session: requests.Session, rng: random.Random) -> RequestRecord:
    """Send one request of a workload drawn from the mix, read its stream, report it."""
    w = pick_workload(PLAN, rng)
    path, body = build_request(w, PLAN, rng)
    return send(env, session, w, path, body, EmbeddingReader if w.endpoint == "embeddings" else StreamReader).rec


def send(
    env: Environment, session: requests.Session, w: Workload, path: str, body: dict, reader_cls: type = StreamReader
):
    """Send one request, read its response with a `reader_cls` (a stream by default), report it;
    returns the reader (its `rec` is the RequestRecord)."""
    stage, level = stage_and_level(env)
    rec = RequestRecord(w.name, w.endpoint, stage, level, time.time(), 0.0)
    reader = reader_cls(rec, time.perf_counter())
    timer = gevent.Timeout(w.timeout_s)
    timer.start()
    try:
        _read(session, PLAN.url + path, body, reader)
    except gevent.Timeout as exc:
        if exc is not timer:
            raise
        rec.error, rec.unanswered, rec.status = f"timeout after {w.timeout_s:g} s", not rec.status, CLIENT_CLOSED
    except GreenletExit:
        # a plan run counts it (the server does: abort/499); plain Locust, like its own HTTP
        # clients, reports nothing for a request it cut when the test stopped
        rec.error, rec.unanswered, rec.status = "stopped by locust before the end", not rec.status, CLIENT_CLOSED
        report(env, reader.finish(time.perf_counter()), to_locust=PLAN_MODE)
        raise
    except requests.RequestException as exc:
        rec.error = f"{'broken stream' if rec.status else 'connection error'}: {type(exc).__name__}"
    finally:
        timer.close()
    report(env, reader.finish(time.perf_counter()))
    return reader


def _fire(
    env: Environment, kind: str, rec: RequestRecord, value: float, length: int = 0, failure: str | None = None
) -> None:
    env.events.request.fire(
        request_type=kind,
        name=rec.workload,
        response_time=value,
        response_length=length,
        exception=RequestFailed(failure) if failure else None,
        context={},
    )


def slo_misses(rec: RequestRecord, goodput: dict[str, float]) -> list[str]:
    """The goodput thresholds a successful request missed, as stable failure names ("ttft > 1000 ms")."""
    return [f"{key[:-3]} > {limit:g} ms" for key, limit in goodput.items() if not meets(rec, {key: limit})]


def report(env: Environment, rec: RequestRecord, to_locust: bool = True) -> None:
    """Custom Locust events (ms; TOKENS in tokens) and one line in records.jsonl."""
    if _records is not None:
        _records.write(rec.to_json() + "\n")
    if not to_locust:
        return
    goodput = PLAN.scenario.goodput
    _slo["requests"] += 1
    if not rec.ok:
        _fire(env, "E2E", rec, rec.e2e * 1000, failure=rec.error)
    else:
        n = rec.output_tokens
        _fire(env, "E2E", rec, rec.e2e * 1000, length=n)
        if rec.ttft is not None:  # None: a non-streaming response (a replay's)
            _fire(env, "TTFT", rec, rec.ttft * 1000)
        if rec.tpot is not None:
            _fire(env, "TPOT", rec, rec.tpot * 1000)
        for gap in rec.itl:
            _fire(env, "ITL", rec, gap * 1000)
        _fire(env, "TOKENS", rec, n, length=n)
        if rec.cached_tokens is not None:
            _fire(env, "CACHED", rec, rec.cached_tokens, length=rec.cached_tokens)
        missed = slo_misses(rec, goodput)
        _slo["good"] += not missed
        _fire(env, "GOODPUT", rec, rec.e2e * 1000, failure=", ".join(missed) or None)


def slo_verdict(environment: Environment) -> tuple[str, bool] | None:
    """(a line, whether the SLO held) for a plain run: the share of requests that succeeded within
    every goodput threshold against the objective; None before any request."""
    n, good = _slo["requests"], _slo["good"]
    if not n or PLAN is None:
        return None
    objective = environment.parsed_options.slo_objective
    slo = ", ".join(f"{k[:-3]} ≤ {v:g} ms" for k, v in PLAN.scenario.goodput.items()) or "no threshold"
    held = good / n >= objective
    return (
        f"SLO {'PASS' if held else 'FAIL'}: {good} of {n} requests ({good / n:.1%}) succeeded within {slo}; "
        f"objective {objective:.1%}"
    ), held


@events.quitting.add_listener
def _quitting(environment: Environment, **_kw) -> None:
    """Locust's CSV writer wakes once a second and gets no last call at shutdown, so the requests
    that finished in the final second (in a closed loop, often all the last ones) would be
    missing from the CSV: give it one more turn.  Plain Locust: print the SLO verdict and turn
    it into the exit code, since Locust would fail the run on a single GOODPUT miss."""
    global _records, _replay_sent
    if _records is not None:  # users that Locust cuts after this (a SIGTERM mid-run) write no record
        f, _records = _records, None
        f.close()
    if _replay_sent is not None:
        f, _replay_sent = _replay_sent, None
        f.close()
    o = environment.parsed_options
    if not PLAN_MODE and (verdict := slo_verdict(environment)):
        line, held = verdict
        print(line, flush=True)
        runner = environment.runner
        others = [e for e in runner.errors.values() if e.method != "GOODPUT"]
        if not held:
            environment.process_exit_code = o.exit_code_on_error
        elif not others and not runner.exceptions and not locust_log.unhandled_greenlet_exception:
            environment.process_exit_code = 0
    if o and o.csv_prefix:
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


def _wait_for_plan() -> None:
    """Idle until there is a plan: without one the test start has said why and is stopping the runner."""
    while PLAN is None:
        gevent.sleep(0.5)


class ClosedLoopUser(User):
    """Closed loop: each user sends its next request when the last one ends (offered load = users).

    The requests follow each other inside one task, so the user is never in Locust's "waiting"
    state: a stop (the run's end, a ramp-down) always finds it running and lets its request end.
    Between tasks Locust kills a waiting user at once, and that kill lands at the next switch —
    inside the connect of the next request, sent or not: the client would count a request the
    server might never have seen."""

    wait_time = constant(0)

    def on_start(self) -> None:
        _wait_for_plan()
        self.session = _session(1)
        self.rng = random.Random(PLAN.seed * 1_000_003 + next(_user_ids))

    @task
    def requests_until_stopped(self) -> None:
        while self._state != LOCUST_STATE_STOPPING:
            if not run_request(self.environment, self.session, self.rng).ok:
                gevent.sleep(PLAN.failure_backoff_s)  # a 503 comes back in milliseconds: no hot loop


class PoissonArrivals(User):
    """Open loop: requests arrive at exponential intervals at the stage's rate, whatever is in flight."""

    wait_time = constant(0)

    def on_start(self) -> None:
        _wait_for_plan()
        self.session = _session(PLAN.max_in_flight)
        self.pool = Pool(PLAN.max_in_flight)  # spawn() blocks at this many open requests
        self.rng = random.Random(PLAN.seed * 1_000_003 + next(_user_ids))

    @task
    def arrive(self) -> None:
        gevent.sleep(self.rng.expovariate(stage_and_level(self.environment)[1]))
        self.pool.spawn(run_request, self.environment, self.session, random.Random(self.rng.random()))

    def on_stop(self) -> None:
        if hasattr(self, "pool"):
            self.pool.join()  # let open requests finish (Locust's --stop-timeout bounds this)


class ReplayUser(User):
    """A recorded dump replayed open loop (`python -m loadtest --replay DIR`): the users share one
    schedule; each takes the next request, sleeps until it is due (its recorded offset ÷ speed after
    the start), sends it as recorded and reads it to the end.  There are enough users that one is
    free whenever a request is due (loadtest/replay/run.py's `users_needed`); how late each was sent is
    written to replay_sent.jsonl with what came back."""

    wait_time = constant(0)

    def on_start(self) -> None:
        _wait_for_plan()
        self.session = _session(1)
        self.workloads = {w.endpoint: w for w in PLAN.workloads}
        if not _replay_started.wait(10):  # spawning_complete did not come: start anyway
            _replay.start(time.perf_counter())
            _replay_started.set()

    @task
    def replay_next(self) -> None:
        item: ReplayItem | None = _replay.take()
        if item is None:
            gevent.sleep(0.2)  # StageShape stops the run once every request has ended
            return
        try:
            gevent.sleep(max(0.0, _replay.t0 + item.due - time.perf_counter()))
            sent = time.perf_counter() - _replay.t0
            reader = send(
                self.environment, self.session, self.workloads[item.endpoint], item.path, item.body, reader_class(item)
            )
            if _replay_sent is not None:
                _replay_sent.write(sent_line(item, sent, reader) + "\n")
        finally:
            _replay.ended += 1
