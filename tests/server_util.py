"""Start a real `sightline serve` in a subprocess (the load-test tools' `LocalServer`) and talk
to it over real HTTP."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.server import LocalServer
from serving.engine.seams import HOLD_SEED_ENV, STEP_FLOOR_ENV

TEST_KEY = "sk-sightline-test-0123456789abcdef"  # the API key of tests/conftest.py's `keyed_server`
# Every test server runs with the hold seam (serving.engine.seams): a request with this seed stops one
# token short of its max_tokens and stays running until `ServerProc.release` or a cut.
HOLD_SEED = 424242
HOLD = {"seed": HOLD_SEED, "ignore_eos": True}  # merge into a body (OpenAI routes) or sampling_params
STARTS_LOG_ENV = "SIGHTLINE_TEST_STARTS_LOG"  # scripts/run_tests.py: one JSON line a server start, for its summary


def _record_start(model: str, flags: tuple[str, ...], seconds: float) -> None:
    """Where the suite's time goes: every server start, its test and how long it took to be healthy."""
    if path := os.environ.get(STARTS_LOG_ENV):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            row = {"test": test, "model": model, "flags": list(flags), "seconds": round(seconds, 2)}
            f.write(json.dumps(row) + "\n")


class ServerProc(LocalServer):
    """A real server for a test: its own TMPDIR (runtime dir, log), the test's env, and
    helpers to read /debug/state and POST JSON."""

    def __init__(
        self,
        *flags: str,
        model: str = "tiny-random",
        tmpdir: Path,
        startup: float = 120.0,
        env: dict[str, str] | None = None,
        step_floor_ms: float = 0,
    ) -> None:
        """`step_floor_ms`: every engine step lasts at least this long (the step-floor seam), for tests
        that need tokens flowing during an event however fast the engine is."""
        self.tmpdir = tmpdir
        extra_env = {
            HOLD_SEED_ENV: str(HOLD_SEED),
            **({STEP_FLOOR_ENV: str(step_floor_ms)} if step_floor_ms else {}),
            **(env or {}),
        }
        key = extra_env.get("SIGHTLINE_API_KEY")
        self.auth = {"authorization": f"Bearer {key}"} if key else {}
        full_env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        full_env["TMPDIR"] = str(tmpdir)
        full_env.update(extra_env)
        if "--dtype" not in flags:  # tests compare with the exact engine and transformers
            flags = ("--dtype", "float32", *flags)
        if "--peak-probe" not in flags:  # the shared tiny server measures the machine; the rest skip its 0.4 s
            flags = ("--no-peak-probe", *flags)
        t0 = time.monotonic()
        super().__init__(model, 0, tmpdir / "server.log", list(flags), startup, env=full_env)
        _record_start(model, flags, time.monotonic() - t0)
        state = self.debug()
        self.pids, self.runtime_dir = state["pids"], Path(state["runtime_dir"])

    def debug(self) -> dict:
        return httpx.get(self.url + "/debug/state", headers=self.auth, timeout=10).json()

    def barrier(self) -> None:
        """Return once everything the engine sent so far (outputs, stats) has reached the front end."""
        httpx.post(self.url + "/debug/barrier", headers=self.auth, timeout=30).raise_for_status()

    def held(self) -> int:
        """Requests the hold seam holds now, over every rank (after a barrier: the latest stats)."""
        self.barrier()
        return sum(s["held"] for s in self.debug()["schedulers"])

    def wait_held(self, n: int, timeout: float = 60.0) -> None:
        """Wait until exactly `n` requests are held (each has sent all but its last token)."""
        wait_until(lambda: self.held() == n, timeout, f"{n} held requests", interval=0.02)

    def release(self, *rids: str, dp_size: int = 1) -> None:
        """Let held requests finish (every one when no rid is given), on each Scheduler rank.  It goes on a
        connection of its own (it works while the server drains), so it is not ordered with a later
        `barrier()`: wait for its effect with `wait_held(k)` or on the streams."""
        from protocol.io_struct import ReleaseHeldReq

        for rank in range(dp_size):
            push(self, "scheduler" if rank == 0 else f"scheduler-{rank}", ReleaseHeldReq(rids=list(rids)))

    def post(self, path: str, body: dict | bytes | str, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=kw.pop("timeout", 120), **kw)


def sse_events(lines) -> list[dict | str]:
    """Parse SSE `data:` lines into JSON objects, keeping the final "[DONE]" as a string."""
    events: list[dict | str] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate()` until it returns something truthy (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)  # clock: the poll interval
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def push_frames(runtime_dir, socket_name: str, *frames: bytes) -> None:
    """Write raw frames onto one of a server's PULL sockets (`scheduler`, `detokenizer`, `tm-sched`,
    `tm-detok`), as any local process of the same user could."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{runtime_dir}/{socket_name}")
    for frame in frames:
        sock.send(frame)
    sock.close(linger=2000)
    ctx.term()


def push(srv: ServerProc, socket_name: str, *msgs) -> None:
    """`push_frames` of our own messages, encoded as the processes encode them."""
    from serving.ipc import Codec

    codec = Codec("test")
    push_frames(srv.runtime_dir, socket_name, *(codec.encode(m) for m in msgs))


class Stream(threading.Thread):
    """A streaming /generate in the background: its events as they arrive, with their arrival times."""

    def __init__(self, srv: LocalServer, prompt: str, params: dict) -> None:
        super().__init__(daemon=True)
        self.srv, self.body = srv, {"text": prompt, "sampling_params": params, "stream": True}
        self.events: list[dict | str] = []
        self.times: list[float] = []
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.srv.url + "/generate", json=self.body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():  # one at a time, as they arrive
                for ev in sse_events([line]):
                    self.events.append(ev)
                    self.times.append(time.monotonic())

    def tokens(self) -> list[int]:
        got = [e for e in self.events if isinstance(e, dict) and "output_ids" in e]
        return got[-1]["output_ids"] if got else []


# -- reading what a server says ------------------------------------------------------------
def chat_ids(model, content: str) -> list[int]:
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(server, path: str, body: dict) -> list[dict | str]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def completion_text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])


def chat_text(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e["choices"])


def scrape(server, openmetrics: bool = False) -> str:
    headers = {"accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    return httpx.get(server.url + "/metrics", headers=headers).text


def samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, **labels) -> float:
    return sum(s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items())


def span_names(srv: ServerProc, rid: str, inputs: int) -> list[str]:
    """The names of an embeddings request's spans once those of all three processes arrived (one prefill per input)."""

    def spans():
        entry = httpx.get(f"{srv.url}/debug/requests/{rid}", timeout=10).json()
        names = [s["name"] for s in entry.get("spans", [])]
        return names if "receive detokenizer" in names and names.count("prefill") >= inputs else None

    return wait_until(spans, 10, "the embeddings request's spans from the three processes")
