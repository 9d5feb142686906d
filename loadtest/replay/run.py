"""Replay a recorded request dump (`--dump-requests DIR`) against a server: `python -m loadtest --replay DIR`.

    python -m loadtest --replay /var/lib/sightline/dump --url http://127.0.0.1:8000 --speed 2

Each record of the dump (telemetry/request_record.py) becomes one request, sent at its
recorded arrival offset from the first replayed record divided by `--speed`, to the same
route, streaming or not, with the recorded sampling parameters and the recorded prompt
when the dump has content (`--dump-content`), otherwise synthetic text of exactly the
recorded prompt token count (counted with the served model's tokenizer, as the server
counts: chat messages through the chat template).  A `/v1/messages` record is sent as a Messages API
body again (loadtest/replay/messages.py: its system prompt, turns and tool blocks from the recorded
chat messages).

Output lengths (`--replay-max-tokens`): `exact` (default) sends max_tokens = the recorded
completion_tokens with ignore_eos and no stop strings, so every replayed request generates
exactly as many tokens as the recorded one did (a synthetic prompt would otherwise stop at
a different point, and so would a request that was cut short); `recorded` sends the recorded
max_new_tokens, ignore_eos and (with content) stop strings instead.

Embeddings, rerank and score records (loadtest/replay/pooling.py) are sent to their own route with
their recorded inputs and options, or as many synthetic inputs of the recorded tokens.

Which records are sent: every request that reached the engine. Requests refused before
admission (`rejected`, `shed`, `unavailable`) and records with neither a prompt nor a prompt
token count are skipped and reported as such; `--include-refused` also sends the `shed` and
`unavailable` ones (offered load that a server with room would have served). `rejected`
requests are never sent: their bodies were invalid and are not in the record.

The schedule is open loop: Locust users (`ReplayUser` in loadtest/locustfile.py) share one
queue of due requests; a free user takes the next one, sleeps until it is due and sends it.
A request is late only when every user is busy with an earlier one, so there are as many
users as the most requests whose windows [due, due + 2 × recorded e2e + 1 s] overlap, plus
one (at most one per request; `--replay-users` overrides).  How late each request was sent
is measured and reported.

The results folder gets `replay.json` (every request recorded vs replayed, the summaries,
the schedule's accuracy), `replay.txt` (the compact table, also printed), `replay.png`
(CDFs of TTFT, TPOT and e2e before vs after, and each request's send lateness), the
schedule (`replay_schedule.jsonl`), what was sent (`replay_sent.jsonl`), `records.jsonl`
and Locust's own files.

Recorded TTFT/TPOT/e2e are the server's (the flight recorder's breakdown: from the HTTP
handler); a replay is measured on both sides: by the server (the `sightline` breakdown in
the usage chunk or response body, the same clock as the recording) and by the client.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx

from loadtest.replay.messages import messages_body
from loadtest.replay.pooling import TOKEN_ID_RANGE, pooling_body, synthetic_inputs
from loadtest.replay.report import analyse
from loadtest.replay.schedule import (
    CONVERSATIONS,
    ENDPOINTS,
    GENERATE,
    MESSAGES,
    POOLING_PATHS,
    RESPONSES,
    SCHEDULE_FILE,
    SENT_FILE,
    ReplayItem,
)
from loadtest.workloads import WORDS
from telemetry.request_record import RequestRecord, read_records

REFUSED = ("rejected", "shed", "unavailable")  # outcomes of requests refused before admission
SENDABLE_REFUSED = ("shed", "unavailable")  # sent too with --include-refused
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
)


# -- prompts --------------------------------------------------------------------------------
class PromptCounter:
    """Prompt tokens as the server counts them (serving/frontend/tokenizer_manager/tokenization.py): a text prompt with
    the tokenizer's special tokens; chat messages rendered by the chat template, then encoded as is."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def text(self, text: str) -> int:
        return len(self.tok(text)["input_ids"])

    def chat(self, messages: list) -> int:
        rendered = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok(rendered, add_special_tokens=False)["input_ids"])

    def user_turn(self, text: str) -> int:
        return self.chat([{"role": "user", "content": text}])


def fit_text(n_tokens: int, count: Callable[[str], int], seed: str) -> tuple[str, int]:
    """Text of English words whose `count` is exactly `n_tokens` when it can be (the words are one
    token each with their leading space in byte-level BPE vocabularies); (text, its count).  Below
    the count of the empty text (a chat template's own tokens) the empty text is the closest."""
    rng = random.Random(seed)
    base = count("")
    if n_tokens <= base:
        return "", base
    words = [rng.choice(WORDS) for _ in range(n_tokens - base)]
    best = ("", base)
    for _ in range(64):
        text = " ".join(words)
        c = count(text)
        if abs(c - n_tokens) < abs(best[1] - n_tokens):
            best = (text, c)
        if c == n_tokens:
            return text, c
        if c < n_tokens:
            words += [rng.choice(WORDS) for _ in range(n_tokens - c)]
        else:
            del words[max(0, len(words) - (c - n_tokens)) :]
            if not words:
                words = [rng.choice(WORDS)]
    return best


def _text(n_tokens: int, counter: PromptCounter | None, seed: str) -> tuple[str, int | None]:
    """A text the server counts as `n_tokens` (with the tokenizer), else `n_tokens` words (count unknown)."""
    if counter is None:
        rng = random.Random(seed)
        return " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens))), None
    return fit_text(n_tokens, counter.text, seed)


def synthetic_prompt(rec: RequestRecord, counter: PromptCounter | None) -> tuple[Any, int | None]:
    """(the prompt to send, its token count as the server will count it; None: not known without a
    tokenizer) for a record without content: exactly `rec.prompt_tokens` tokens whenever possible."""
    seed = f"sightline-replay-{rec.rid}"
    n = rec.prompt_tokens
    if rec.route in POOLING_PATHS:  # the recorded number of inputs, the tokens spread over them
        return synthetic_inputs(rec.route, rec.params or {}, n, seed, lambda m, s: _text(m, counter, s))
    if rec.route in CONVERSATIONS:
        if counter is None:  # about one token a word, after a chat template's ~30 tokens of its own
            rng = random.Random(seed)
            return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(max(1, n - 30)))}], None
        text, c = fit_text(n, counter.user_turn, seed)
        return [{"role": "user", "content": text}], c
    if counter is None:  # token ids: exact without a tokenizer
        rng = random.Random(seed)
        return [rng.randint(*TOKEN_ID_RANGE) for _ in range(max(1, n))], max(1, n)
    return fit_text(n, counter.text, seed)


# -- one request ------------------------------------------------------------------------------
def build_request(rec: RequestRecord, prompt: Any, model: str, max_tokens_mode: str = "exact") -> tuple[str, dict]:
    """The path and JSON body that replay `rec` with `prompt` (a text, chat messages or token ids)."""
    p = rec.params or {}
    if rec.route in POOLING_PATHS:  # as recorded: the inputs and the options of the route's body
        return rec.route, pooling_body(rec.route, p, prompt, model)
    sampling = {k: p[k] for k in SAMPLING_KEYS if p.get(k) is not None}
    if max_tokens_mode == "exact":
        max_tokens, ignore_eos, stop = max(1, rec.completion_tokens), True, None
    else:
        max_tokens, ignore_eos = p.get("max_new_tokens"), bool(p.get("ignore_eos"))
        stop = p.get("stop_strings") or None
    if rec.route == MESSAGES:
        return MESSAGES, messages_body(
            prompt, model, sampling, max_tokens or p.get("max_new_tokens") or 1, ignore_eos, stop, rec.stream
        )
    if rec.route == GENERATE:
        sp = {**sampling, "ignore_eos": ignore_eos}
        if max_tokens is not None:
            sp["max_new_tokens"] = max_tokens
        if stop:
            sp["stop"] = stop
        key = "text" if isinstance(prompt, str) else "input_ids"
        return GENERATE, {key: prompt, "sampling_params": sp, "stream": rec.stream}
    body: dict = {"model": model, **sampling, "stream": rec.stream}
    if rec.route == RESPONSES:  # the messages as input items, not stored (a replay continues no conversation)
        body.update(input=input_items(prompt), store=False)
    if max_tokens is not None:
        body["max_output_tokens" if rec.route == RESPONSES else "max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    if stop:
        body["stop"] = stop
    if rec.route == RESPONSES:
        return rec.route, body
    if rec.stream:
        body["stream_options"] = {"include_usage": True}
    body["messages" if rec.route in CONVERSATIONS else "prompt"] = prompt
    return rec.route, body


def input_items(messages: list[dict]) -> list[dict]:
    """Chat messages as /v1/responses input items: an assistant's calls as `function_call` items, a tool's
    answer as a `function_call_output` one."""
    items: list[dict] = []
    for m in messages:
        if m.get("role") == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": m.get("tool_call_id") or "",
                    "output": m.get("content") or "",
                }
            )
            continue
        if m.get("content") or not m.get("tool_calls"):
            items.append({"role": m["role"], "content": m.get("content") or ""})
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            args = fn.get("arguments")
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id") or "",
                    "name": fn.get("name") or "",
                    "arguments": args if isinstance(args, str) else json.dumps(args or {}),
                }
            )
    return items


def skip_reason(rec: RequestRecord, include_refused: bool) -> str | None:
    if rec.route not in ENDPOINTS:
        return f"route {rec.route} is not replayed"
    if rec.outcome == "rejected":
        return "refused before admission (rejected)"
    if rec.outcome in REFUSED and not (include_refused and rec.outcome in SENDABLE_REFUSED):
        return f"refused before admission ({rec.outcome})"
    if rec.prompt is None and rec.prompt_tokens <= 0:
        return "neither a prompt nor its token count was recorded"
    return None


def plan_schedule(
    records: Iterable[RequestRecord], speed: float = 1.0, include_refused: bool = False
) -> tuple[list[tuple[RequestRecord, float]], list[tuple[RequestRecord, str]]]:
    """(records to replay with their due offsets in seconds, in arrival order; records skipped with
    why).  Offsets count from the first replayed record's arrival, divided by `speed`."""
    if speed <= 0:
        raise ValueError("--speed must be > 0")
    recs = sorted(records, key=lambda r: r.arrival)  # the recorder writes requests as they end
    skipped = [(r, why) for r in recs if (why := skip_reason(r, include_refused))]
    kept = [r for r in recs if not skip_reason(r, include_refused)]
    t0 = kept[0].arrival if kept else 0.0
    return [(r, (r.arrival - t0) / speed) for r in kept], skipped


def make_items(
    planned: list[tuple[RequestRecord, float]],
    model: str,
    counter: PromptCounter | None,
    max_tokens_mode: str = "exact",
) -> list[ReplayItem]:
    items = []
    for i, (rec, due) in enumerate(planned):
        if rec.prompt is not None:
            prompt, source, sent = rec.prompt, "recorded", rec.prompt_tokens
            if rec.route in CONVERSATIONS and isinstance(prompt, str):  # a chat record holds messages; be lenient
                prompt = [{"role": "user", "content": prompt}]
        else:
            (prompt, sent), source = synthetic_prompt(rec, counter), "synthetic"
        path, body = build_request(rec, prompt, model, max_tokens_mode)
        items.append(
            ReplayItem(
                i,
                rec.rid,
                round(due, 6),
                path,
                body,
                rec.stream,
                source,
                rec.prompt_tokens,
                sent,
                (rec.breakdown.get("e2e_ms") or 0.0) / 1000.0,
            )
        )
    return items


def users_needed(items: list[ReplayItem]) -> int:
    """Enough users that one is free whenever a request is due: the most requests whose windows
    [due, due + 2 × recorded e2e + 1 s] overlap (replayed requests may run slower than recorded),
    plus one; at most one per request."""
    events = sorted(
        [(it.due, 1) for it in items] + [(it.due + 2 * it.recorded_e2e_s + 1.0, -1) for it in items],
        key=lambda e: (e[0], e[1]),
    )
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return max(1, min(len(items), peak + 1))


# -- the command ---------------------------------------------------------------------------------
def load_counter(spec: str | None) -> PromptCounter | None:
    """The served model's tokenizer (any model spec `sightline serve --model` takes), or None with a
    note: synthetic prompts are then token ids (completions, /generate) or about one word a token (chat)."""
    if not spec:
        return None
    try:
        from serving.model_files import load_tokenizer

        return PromptCounter(load_tokenizer(spec)[0])
    except Exception as exc:  # noqa: BLE001 - any failure: fall back, say so
        print(
            f"note: no tokenizer for {spec!r} ({exc}); synthetic prompts are token ids (completions, "
            "/generate) or approximate (chat); give --tokenizer MODEL",
            file=sys.stderr,
        )
        return None


def warm_up(url: str, items: list[ReplayItem], headers: dict[str, str]) -> None:
    """One short non-streaming request per route of the schedule, so first-call costs stay out of the replay."""
    seen = set()
    for it in items:
        if it.path in seen:
            continue
        seen.add(it.path)
        body = json.loads(json.dumps(it.body))
        body["stream"] = False
        body.pop("stream_options", None)
        if it.path == GENERATE:
            body["sampling_params"]["max_new_tokens"] = 2
        elif it.path in POOLING_PATHS:
            body.pop("stream")
        elif it.path == RESPONSES:
            body["max_output_tokens"] = 2
        else:
            body["max_tokens"] = 2
        httpx.post(url + it.path, json=body, headers=headers, timeout=120)


def run_replay(a: Any) -> int:
    """`python -m loadtest --replay DIR` (arguments parsed by loadtest/__main__.py)."""
    from loadtest.config import Plan, Scenario, Shape, Workload
    from loadtest.run import run_locust, stamp
    from loadtest.server import REPO, auth_headers, facts, target

    dump = Path(a.replay)
    if not dump.exists():
        print(f"error: {dump} does not exist", file=sys.stderr)
        return 2
    all_records = list(read_records(dump))
    if not all_records:
        print(f"error: no request record in {dump}", file=sys.stderr)
        return 2
    try:
        planned, skipped = plan_schedule(all_records, a.speed, a.include_refused)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not planned:
        print(f"error: nothing to replay in {dump}: {dict(Counter(w for _, w in skipped))}", file=sys.stderr)
        return 2
    out = a.out or REPO / "results" / "replay" / f"{dump.name or 'dump'}-{stamp()}"
    if (out / SENT_FILE).exists():
        print(f"error: {out} already holds a replay; give another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        model = a.model or Counter(r.model for r in all_records).most_common(1)[0][0]
        url, server = target(a.url, model, a.port, out / "server.log", a.server_arg)
        served = facts(url).model
        counter = load_counter(a.tokenizer or served) if any(r.prompt is None for r, _ in planned) else None
        items = make_items(planned, served, counter, a.replay_max_tokens)
        users = a.replay_users or users_needed(items)
        (out / SCHEDULE_FILE).write_text("".join(it.to_json() + "\n" for it in items))
        timeout_s = a.request_timeout
        endpoints = sorted({it.endpoint for it in items})
        workloads = [Workload(f"replay-{e}", e, (1, 1), timeout_s=timeout_s) for e in endpoints]
        duration = items[-1].due + timeout_s + 5
        plan = Plan(
            url,
            served,
            Scenario("replay", {w.name: 1.0 for w in workloads}, "replay", Shape((float(users),), duration)),
            workloads,
            str(out / "records.jsonl"),
            a.seed,
        )
        (out / "plan.json").write_text(plan.to_json())
        warm_up(url, items, auth_headers())
        print(
            f"replaying {len(items)} of {len(all_records)} requests from {dump} at ×{a.speed:g} "
            f"({items[-1].due:.1f} s of arrivals), {users} users, against {url}",
            flush=True,
        )
        started = time.time()
        rc = run_locust(plan, out)
    except (OSError, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        print(f"error: {exc} (logs in {out})", file=sys.stderr)
        return 3
    finally:
        if server is not None:
            server.stop()
    if rc != 0:
        print(f"warning: locust exited with {rc}; see {out / 'locust.log'}", file=sys.stderr)
    run = {
        "url": url,
        "model": served,
        "speed": a.speed,
        "max_tokens": a.replay_max_tokens,
        "users": users,
        "include_refused": a.include_refused,
        "started_at": started,
        "locust_exit_code": rc,
        "local_server": server is not None,
        "synthetic_prompts": sum(it.prompt_source == "synthetic" for it in items),
        "prompt_tokens_exact": all(it.prompt_tokens_sent == it.prompt_tokens for it in items),
    }
    doc = analyse(out, dump, all_records, planned, skipped, items, run)
    print(doc["text"])
    return 0 if doc["sent"] == len(items) else 3
