"""loadtest/replay/ without a server: the schedule from a dump, speed scaling, which records are
sent, synthetic prompts of exactly the recorded token count (counted as the server counts them),
recorded prompts sent as they were, request bodies, the readers of replayed responses, and the
report's pairing of recorded vs replayed requests."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from PIL import Image

from loadtest.records import RequestRecord as ClientRecord
from loadtest.replay.readers import ReplayBodyReader, ReplayStreamReader, sent_line
from loadtest.replay.report import analyse
from loadtest.replay.run import PromptCounter, build_request, make_items, plan_schedule, users_needed
from loadtest.replay.schedule import CHAT, COMPLETIONS, GENERATE, ReplayQueue
from serving.frontend.tokenizer_manager.tokenization import PromptTokenizer
from telemetry.request_record import RequestRecord, encode, read_records

T0 = 1_750_000_000.0


def rec(i: int, arrival: float, route: str = COMPLETIONS, **kw) -> RequestRecord:
    base = dict(
        arrival=T0 + arrival,
        rid=f"r{i}",
        route=route,
        operation={CHAT: "chat", GENERATE: "generate"}.get(route, "text_completion"),
        model="tiny-random",
        stream=True,
        prompt_tokens=20,
        completion_tokens=8,
        outcome="length",
        finish_reason="length",
        params={"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0},
        breakdown={"ttft_ms": 40.0, "tpot_ms": 10.0, "e2e_ms": 110.0},
    )
    base.update(kw)
    return RequestRecord(**base)


@pytest.fixture(scope="module")
def tok():
    from serving.model_files import load_tokenizer

    return load_tokenizer("tiny-random")[0]


def server_count(tok, path: str, body: dict) -> int:
    """The prompt tokens the server will count for this body (its own PromptTokenizer)."""
    if path == CHAT:
        obj = SimpleNamespace(messages=body["messages"], prompt=None)
    elif path == GENERATE:
        obj = SimpleNamespace(messages=None, prompt=body.get("text", body.get("input_ids")))
    else:
        obj = SimpleNamespace(messages=None, prompt=body["prompt"])
    return len(PromptTokenizer(tok).encode_sync(obj, tok.vocab_size + 1000))


def test_schedule_in_arrival_order_from_the_first_replayed_record():
    # the recorder writes requests as they end: arrivals out of order in the file
    records = [rec(2, 3.0), rec(0, 1.0, outcome="rejected", status=400, prompt_tokens=0), rec(1, 1.5), rec(3, 2.0)]
    planned, skipped = plan_schedule(records)
    assert [r.rid for r, _ in planned] == ["r1", "r3", "r2"]
    assert [due for _, due in planned] == pytest.approx([0.0, 0.5, 1.5])  # from r1, the first replayed
    assert [(r.rid, why) for r, why in skipped] == [("r0", "refused before admission (rejected)")]


def test_speed_divides_every_offset():
    records = [rec(i, t) for i, t in enumerate([0.0, 0.4, 1.0, 7.5])]
    dues = {s: [d for _, d in plan_schedule(records, speed=s)[0]] for s in (1.0, 2.0, 0.5)}
    assert dues[2.0] == pytest.approx([d / 2 for d in dues[1.0]])
    assert dues[0.5] == pytest.approx([d * 2 for d in dues[1.0]])
    with pytest.raises(ValueError):
        plan_schedule(records, speed=0)


def test_refused_requests_are_skipped_unless_asked_and_rejected_ones_always():
    records = [
        rec(0, 0.0),
        rec(1, 0.1, outcome="shed", status=429),
        rec(2, 0.2, outcome="unavailable", status=503),
        rec(3, 0.3, outcome="rejected", status=400),
        rec(4, 0.4, route="/encode"),
        rec(5, 0.5, prompt_tokens=0),
        rec(6, 0.6, outcome="client_disconnect", completion_tokens=0),
    ]
    planned, skipped = plan_schedule(records)
    assert [r.rid for r, _ in planned] == ["r0", "r6"]  # a client that left still loaded the engine
    assert {r.rid for r, _ in skipped} == {"r1", "r2", "r3", "r4", "r5"}
    planned, skipped = plan_schedule(records, include_refused=True)
    assert [r.rid for r, _ in planned] == ["r0", "r1", "r2", "r6"]
    assert {r.rid for r, _ in skipped} == {"r3", "r4", "r5"}


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT, GENERATE])
def test_synthetic_prompts_have_exactly_the_recorded_token_count(tok, route):
    counter = PromptCounter(tok)
    lengths = [1, 2, 7, 31, 32, 64, 257, 1000] if route != CHAT else [31, 32, 45, 100, 513, 1500]
    records = [rec(i, i * 0.1, route=route, prompt_tokens=n) for i, n in enumerate(lengths)]
    items = make_items(plan_schedule(records)[0], "tiny-random", counter)
    for item, n in zip(items, lengths):
        assert item.prompt_source == "synthetic"
        assert item.prompt_tokens_sent == n
        assert server_count(tok, item.path, item.body) == n, (route, n)
    texts = [json.dumps(it.body) for it in items]
    assert len(set(texts)) == len(texts)  # each record its own text
    again = make_items(plan_schedule(records)[0], "tiny-random", counter)
    assert [it.body for it in again] == [it.body for it in items]  # the same dump, the same prompts


def test_synthetic_chat_prompt_below_the_template_is_the_closest_possible(tok):
    counter = PromptCounter(tok)
    (item,) = make_items(plan_schedule([rec(0, 0.0, route=CHAT, prompt_tokens=5)])[0], "m", counter)
    assert item.body["messages"] == [{"role": "user", "content": ""}]
    assert item.prompt_tokens_sent == server_count(tok, CHAT, item.body) > 5


def test_without_a_tokenizer_completions_get_exact_token_ids():
    (item,) = make_items(plan_schedule([rec(0, 0.0, prompt_tokens=123)])[0], "m", None)
    assert isinstance(item.body["prompt"], list) and len(item.body["prompt"]) == 123
    assert item.prompt_tokens_sent == 123


def test_recorded_prompts_are_sent_exactly(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    records = [
        rec(0, 0.0, prompt="The capital of France is"),
        rec(1, 0.1, route=CHAT, prompt=messages),
        rec(2, 0.2, prompt=[11, 22, 33, 44]),
        rec(3, 0.3, route=GENERATE, prompt="Once upon a time", stream=False),
        rec(4, 0.4, route=GENERATE, prompt=[5, 6, 7]),
    ]
    items = make_items(plan_schedule(records)[0], "tiny-random", PromptCounter(tok))
    assert [it.prompt_source for it in items] == ["recorded"] * 5
    assert items[0].body["prompt"] == "The capital of France is"
    assert items[1].body["messages"] == messages
    assert items[2].body["prompt"] == [11, 22, 33, 44]
    assert items[3].body["text"] == "Once upon a time" and items[3].body["stream"] is False
    assert items[4].body["input_ids"] == [5, 6, 7]


def test_request_bodies_exact_and_recorded_output_lengths():
    r = rec(
        0,
        0.0,
        route=CHAT,
        completion_tokens=13,
        params={
            "max_new_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "seed": 7,
            "ignore_eos": False,
            "stop_token_ids": 0,
            "stop": 1,
            "stop_strings": ["\n\n"],
        },
    )
    msgs = [{"role": "user", "content": "x"}]
    path, body = build_request(r, msgs, "served")
    assert path == CHAT
    assert body == {
        "model": "served",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 7,
        "stream": True,
        "max_tokens": 13,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": msgs,
    }
    _, body = build_request(r, msgs, "served", "recorded")
    assert body["max_tokens"] == 64 and "ignore_eos" not in body and body["stop"] == ["\n\n"]
    g = rec(1, 0.0, route=GENERATE, stream=False, completion_tokens=0, params={"max_new_tokens": 4})
    path, body = build_request(g, "hello", "served")
    assert path == GENERATE
    assert body == {"text": "hello", "sampling_params": {"ignore_eos": True, "max_new_tokens": 1}, "stream": False}


def test_users_cover_the_recorded_overlap():
    records = [rec(i, t, breakdown={"e2e_ms": 1000.0}) for i, t in enumerate([0.0, 0.1, 0.2, 10.0, 20.0])]
    items = make_items(plan_schedule(records)[0], "m", None)
    assert users_needed(items) == 4  # three overlapping (each ~3 s window), plus one
    fast = make_items(plan_schedule(records, speed=100.0)[0], "m", None)
    assert users_needed(fast) == 5  # at most one per request
    q = ReplayQueue(list(reversed(items)))
    assert [q.take().index for _ in items] == [0, 1, 2, 3, 4] and q.take() is None


def test_dump_directory_round_trip(tmp_path):
    records = [rec(i, float(i), prompt="p" if i % 2 else None) for i in range(4)]
    (tmp_path / "requests-20250101T000000-0.jsonl").write_bytes(b"".join(encode(r) + b"\n" for r in records[:2]))
    (tmp_path / "requests-20250101T000001-1.jsonl").write_bytes(b"".join(encode(r) + b"\n" for r in records[2:]))
    assert [r.rid for r in read_records(tmp_path)] == ["r0", "r1", "r2", "r3"]


# -- readers -----------------------------------------------------------------------------------
def _feed(reader, events: list, step: float = 0.01):
    t = reader.sent_at
    for ev in events:
        t += step
        reader.feed(f"data: {ev if isinstance(ev, str) else json.dumps(ev)}\n\n".encode(), t)
    return reader.finish(t + step)


def test_generate_stream_reader():
    r = ReplayStreamReader(ClientRecord("replay-generate", "generate", 0, 1.0, T0, 0.0), 100.0)
    bd = {"ttft_ms": 12.0, "e2e_ms": 50.0}
    out = _feed(
        r,
        [
            {"text": "Hel", "meta_info": {"finish_reason": None, "prompt_tokens": 5, "completion_tokens": 1}},
            {"text": "Hello", "meta_info": {"finish_reason": None, "prompt_tokens": 5, "completion_tokens": 2}},
            {
                "text": "Hello!",
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "prompt_tokens": 5,
                    "completion_tokens": 3,
                    "cached_tokens": 0,
                    "sightline": bd,
                },
            },
            "[DONE]",
        ],
    )
    assert out.ok, out.error
    assert out.finish_reason == "length" and out.completion_tokens == 3 and out.prompt_tokens == 5
    assert out.ttft == pytest.approx(0.01) and len(out.chunk_times) == 3
    assert r.server == bd


def test_openai_stream_reader_keeps_the_server_breakdown():
    r = ReplayStreamReader(ClientRecord("replay-completions", "completions", 0, 1.0, T0, 0.0), 0.0)
    bd = {"ttft_ms": 9.0, "e2e_ms": 30.0}
    out = _feed(
        r,
        [
            {"choices": [{"text": "a", "finish_reason": None}]},
            {"choices": [{"text": "b", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}, "sightline": bd},
            "[DONE]",
        ],
    )
    assert out.ok and out.completion_tokens == 2 and r.server == bd


@pytest.mark.parametrize(
    "body",
    [
        {
            "choices": [{"text": "ab", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2},
            "sightline": {"ttft_ms": 5.0},
        },
        {
            "text": "ab",
            "output_ids": [1, 2],
            "meta_info": {
                "finish_reason": {"type": "length"},
                "prompt_tokens": 4,
                "completion_tokens": 2,
                "sightline": {"ttft_ms": 5.0},
            },
        },
    ],
)
def test_body_reader(body):
    r = ReplayBodyReader(ClientRecord("replay", "completions", 0, 1.0, T0, 0.0), 1.0)
    r.feed(json.dumps(body).encode()[:10], 1.1)
    r.feed(json.dumps(body).encode()[10:], 1.2)
    out = r.finish(1.5)
    assert out.ok and out.e2e == pytest.approx(0.5) and out.ttft is None
    assert (out.prompt_tokens, out.completion_tokens, out.finish_reason) == (4, 2, "length")
    assert r.server == {"ttft_ms": 5.0}


# -- the report --------------------------------------------------------------------------------
def test_report_pairs_recorded_and_replayed_requests(tmp_path):
    records = [
        rec(i, i * 0.5, breakdown={"ttft_ms": 10.0 * (i + 1), "tpot_ms": 5.0, "e2e_ms": 50.0 + i}) for i in range(4)
    ]
    records.append(rec(9, 0.2, outcome="shed", status=429, prompt_tokens=0))
    planned, skipped = plan_schedule(records, speed=2.0)
    items = make_items(planned, "tiny-random", None)
    lines = []
    for it in reversed(items[:3]):  # written in the order they ended; the last one never sent
        c = ClientRecord(
            "replay-completions",
            "completions",
            0,
            3.0,
            T0 + it.due,
            0.2,
            200,
            "length",
            None,
            0.05,
            [0.05, 0.1, 0.15],
            20,
            8,
            0,
        )
        reader = SimpleNamespace(
            rec=c, request_id=f"new-{it.index}", server={"ttft_ms": 40.0 + it.index, "e2e_ms": 180.0}
        )
        lines.append(sent_line(it, it.due + 0.003 * it.index, reader))
    (tmp_path / "replay_sent.jsonl").write_text("\n".join(lines) + "\n")
    run = {"url": "http://x", "model": "tiny-random", "speed": 2.0, "max_tokens": "exact", "users": 2}
    doc = analyse(tmp_path, tmp_path / "dump", records, planned, skipped, items, run)

    rows = doc["requests"]
    assert [r["rid"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert [r["sent"] for r in rows] == [True, True, True, False]
    assert [r["due_s"] for r in rows] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert rows[2]["late_ms"] == pytest.approx(6.0)
    assert rows[1]["recorded"]["ttft_ms"] == 20.0 and rows[1]["replayed"]["server"]["ttft_ms"] == 41.0
    assert rows[1]["replayed"]["server"]["tpot_ms"] == pytest.approx((180.0 - 41.0) / 7, abs=1e-3)
    assert rows[1]["replayed"]["client"]["ttft_ms"] == pytest.approx(50.0)
    assert rows[1]["request_id"] == "new-1"
    assert doc["sent"] == 3 and doc["replayed"] == 4 and doc["skipped"] == 1
    assert doc["outcomes"] == {
        "recorded_all": {"length": 4, "shed": 1},
        "recorded": {"length": 4},
        "replayed": {"length": 3},
    }
    lat = doc["latency"]["ttft_ms"]
    assert lat["recorded"]["count"] == 4 and lat["replayed_server"]["count"] == 3
    assert lat["recorded"]["max"] == 40.0 and lat["replayed_server"]["max"] == 42.0
    assert doc["prompt_tokens_match"] == 3 and doc["completion_tokens_match"] == 3
    text = (tmp_path / "replay.txt").read_text()
    assert "NOT SENT" in text and "ttft_ms" in text and "outcomes: recorded {'length': 4}" in text
    saved = json.loads((tmp_path / "replay.json").read_text())
    assert saved["requests"] == json.loads(json.dumps(rows))
    meta = Image.open(tmp_path / "replay.png").text
    assert json.loads(meta["sightline:replay"])["ttft_ms:server"] == 3


def test_sent_line_round_trip():
    it = make_items(plan_schedule([rec(0, 0.0)])[0], "m", None)[0]
    c = ClientRecord("w", "completions", 0, 1.0, T0, 0.1)
    line = json.loads(sent_line(it, 0.25, SimpleNamespace(rec=c, request_id="x", server=None)))
    assert line["index"] == 0 and line["rid"] == "r0" and line["sent_s"] == 0.25
    assert ClientRecord(**line["record"]) == c and asdict(c) == line["record"]


def test_embeddings_records_are_replayed_with_their_inputs():
    """An embeddings record: as many synthetic token-id inputs as recorded, exactly its prompt tokens; recorded
    inputs sent as they were, with the options that shape the vectors; the body reader takes the response."""
    from loadtest.replay.run import synthetic_prompt
    from loadtest.replay.schedule import EMBEDDINGS

    r = rec(
        0,
        0.0,
        EMBEDDINGS,
        operation="embeddings",
        stream=False,
        prompt_tokens=23,
        completion_tokens=0,
        outcome="ok",
        finish_reason="stop",
        params={
            "inputs": 3,
            "normalize": True,
            "dimensions": 16,
            "truncate_prompt_tokens": None,
            "encoding_format": "float",
        },
    )
    prompt, sent = synthetic_prompt(r, None)
    assert len(prompt) == 3 and sent == 23 == sum(map(len, prompt))
    path, body = build_request(r, prompt, "m")
    assert path == EMBEDDINGS and body == {
        "model": "m",
        "input": prompt,
        "normalize": True,
        "dimensions": 16,
        "encoding_format": "float",
    }
    (item,) = make_items(
        [(rec(1, 0.0, EMBEDDINGS, stream=False, prompt=["a b", "c"], params={"inputs": 2}), 0.0)], "m", None
    )
    assert item.body["input"] == ["a b", "c"] and item.endpoint == "embeddings"
    reader = ReplayBodyReader(ClientRecord("replay", "embeddings", 0, 1.0, T0, 0.0), 1.0)
    reader.feed(
        json.dumps(
            {
                "object": "list",
                "data": [{"embedding": [0.1]}],
                "usage": {"prompt_tokens": 4},
                "sightline": {"e2e_ms": 3.0},
            }
        ).encode(),
        1.1,
    )
    out = reader.finish(1.2)
    assert out.ok and (out.prompt_tokens, out.completion_tokens, out.finish_reason) == (4, 0, "stop")
    assert reader.server == {"e2e_ms": 3.0}


def test_rerank_and_score_records_are_replayed_as_their_bodies_were(tok):
    """A rerank record's inputs are its query then its documents, a score record's text_1 then text_2: the
    replayed body is the recorded one (documents as objects, top_n, a string text_1); without content, as many
    synthetic texts as recorded inputs, exactly the recorded tokens; the body reader takes a rerank answer."""
    from loadtest.replay.run import synthetic_prompt

    kw = dict(operation="embeddings", stream=False, completion_tokens=0, outcome="stop", finish_reason="stop")
    rerank = rec(
        0,
        0.0,
        "/v2/rerank",
        prompt=["q", "d0", "d1"],
        params={"inputs": 3, "top_n": 1, "return_documents": False, "document_objects": True},
        **kw,
    )
    score = rec(1, 0.1, "/v1/score", prompt=["a", "b", "c"], params={"inputs": 3, "text_1": None, "text_2": 2}, **kw)
    pairs = rec(2, 0.2, "/score", prompt=["a", "b", "c", "d"], params={"inputs": 4, "text_1": 2, "text_2": 2}, **kw)
    items = make_items(plan_schedule([rerank, score, pairs])[0], "m", None)
    assert (items[0].path, items[0].endpoint) == ("/v2/rerank", "rerank")
    assert items[0].body == {
        "model": "m",
        "query": "q",
        "documents": [{"text": "d0"}, {"text": "d1"}],
        "top_n": 1,
        "return_documents": False,
    }
    assert items[1].body == {"model": "m", "text_1": "a", "text_2": ["b", "c"]} and items[1].endpoint == "score"
    assert items[2].body == {"model": "m", "text_1": ["a", "b"], "text_2": ["c", "d"]}
    synthetic = rec(3, 0.0, "/v1/rerank", prompt_tokens=40, params={"inputs": 4, "top_n": None}, **kw)
    inputs, sent = synthetic_prompt(synthetic, PromptCounter(tok))
    assert len(inputs) == 4 and all(isinstance(t, str) for t in inputs)
    assert sent == 40 == sum(PromptCounter(tok).text(t) for t in inputs)
    (item,) = make_items([(synthetic, 0.0)], "m", None)
    assert item.prompt_tokens_sent is None and len(item.body["documents"]) == 3  # no tokenizer: about a word a token
    reader = ReplayBodyReader(ClientRecord("replay", "rerank", 0, 1.0, T0, 0.0), 1.0)
    reader.feed(
        json.dumps(
            {
                "id": "rerank-x",
                "results": [{"index": 0, "relevance_score": 0.5}],
                "usage": {"prompt_tokens": 7, "total_tokens": 7},
                "sightline": {"e2e_ms": 2.0},
            }
        ).encode(),
        1.1,
    )
    out = reader.finish(1.2)
    assert out.ok and (out.prompt_tokens, out.finish_reason) == (7, "stop") and reader.server == {"e2e_ms": 2.0}


def test_messages_records_are_replayed_as_messages_bodies():
    """A /v1/messages record: its recorded chat messages sent back as the Messages body they came from (system,
    tool_use and tool_result blocks), only the Messages API's sampling fields; its stream and body read back."""
    from loadtest.replay.schedule import MESSAGES

    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    r = rec(
        0,
        0.0,
        MESSAGES,
        operation="chat",
        prompt=chat,
        completion_tokens=5,
        params={
            "max_new_tokens": 16,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "stop_strings": ["END"],
        },
    )
    (item,) = make_items([(r, 0.0)], "m", None)
    assert item.path == MESSAGES and item.endpoint == "messages"
    assert item.body == {
        "model": "m",
        "max_tokens": 5,
        "stream": True,
        "temperature": 0.0,
        "top_p": 1.0,
        "system": "Be brief.",
        "ignore_eos": True,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    }
    _, recorded = build_request(r, chat, "m", "recorded")
    assert recorded["max_tokens"] == 16 and recorded["stop_sequences"] == ["END"] and "ignore_eos" not in recorded
    bd = {"ttft_ms": 9.0, "e2e_ms": 30.0}
    stream = ReplayStreamReader(ClientRecord("replay-messages", "messages", 0, 1.0, T0, 0.0), 0.0)
    out = _feed(
        stream,
        [
            {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 0}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                "sightline": bd,
                "usage": {"input_tokens": 2, "cache_read_input_tokens": 7, "output_tokens": 5},
            },
            {"type": "message_stop"},
        ],
    )
    assert out.ok, out.error
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens, out.finish_reason) == (9, 7, 5, "length")
    assert out.ttft == pytest.approx(0.03) and stream.server == bd
    body = ReplayBodyReader(ClientRecord("replay", "messages", 0, 1.0, T0, 0.0), 1.0)
    body.feed(
        json.dumps(
            {
                "type": "message",
                "stop_reason": "end_turn",
                "sightline": bd,
                "usage": {"input_tokens": 3, "cache_read_input_tokens": 0, "output_tokens": 2},
            }
        ).encode(),
        1.1,
    )
    out = body.finish(1.2)
    assert out.ok and (out.prompt_tokens, out.completion_tokens, out.finish_reason) == (3, 2, "stop")
