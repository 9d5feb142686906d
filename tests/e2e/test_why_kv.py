"""Why it waited and why it missed the cache when KV runs out, on one real tiny-random server with a small KV
pool: a held stream with a long prompt takes most of it, a second stream outgrows the rest and is retracted
(it waited `retracted`; its gap's cause: retraction), a long prompt that does not fit beside the resumed stream
waits (kv_capacity) and a request queued behind it too (queue_order), a request on an idle engine does not
(next_step); every request's reasons sum to its queue time, and the counters move by exactly what those requests
went through.
A prompt the held stream pushed out of the prefix cache misses as `evicted` (where its match ended, how much had
been evicted), a new one as `never_seen` — in its prefill span and the counter, never in the response."""

from __future__ import annotations

import threading

import pytest

from tests.e2e.test_why_slow import Stream, counter, entry, generate, waiting
from tests.server_util import ServerProc, wait_until

POOL = 512  # KV slots
PROMPT = [100 + j % 500 for j in range(200)]  # one leaf of 200 + 1 computed positions once it has run
HELD_PROMPT = [12000 + j for j in range(460)]  # with the held stream's first two tokens: 462 slots, 50 left
HELD_TOKENS = 4  # it streams 3, then holds its slots until released
GROWER_TOKENS = 64  # 8 + 64 positions: past the 50 slots beside the held stream, well within the empty pool
BIG = [20000 + j for j in range(480)]  # fits the empty pool, not beside the resumed stream


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc(
        "--max-total-tokens",
        str(POOL),
        "--max-running-requests",
        "8",
        "--max-prefill-tokens",
        "512",
        "--max-step-tokens",
        "512",
        "--step-time-factor",
        "0",  # the token caps alone: a prompt's chunks do not depend on how fast this machine is
        "--init-new-token-ratio",
        "0.05",  # admit the second stream: the estimate is far below its need
        "--decode-gap-factor",
        "3",
        "--decode-gap-floor",
        "0.005",
        "--heartbeat-interval",
        "0.2",
        tmpdir=tmp_path_factory.mktemp("why-kv"),
    )
    yield srv
    srv.stop()


def summary(srv: ServerProc, rid: str, span: str = "decode") -> tuple[dict, list[dict]]:
    """The rid's /debug/requests record (its breakdown at the top level) and its spans."""
    e = entry(srv, rid, span)
    return e, e["spans"]


def sums_to_queue(b: dict) -> None:
    waits = b["wait_ms"]
    assert waits and abs(sum(waits.values()) - b["queue_ms"]) < 0.01 * len(waits), b


def first_prefill(spans: list[dict]) -> dict:
    return next(s for s in spans if s["name"] == "prefill" and s["attributes"]["sightline.prefill.chunk"] == 0)


def misses(srv: ServerProc) -> dict[str, float]:
    return {
        r: counter(srv, "sightline_prefix_cache_misses_total", reason=r) for r in ("evicted", "never_seen", "too_short")
    }


def retraction_gaps(spans: list[dict]) -> int:
    return sum(
        1
        for s in spans
        if s["name"] == "decode"
        for e in s["events"]
        if e["name"] == "decode_gap" and e["attributes"]["sightline.decode_gap.cause"] == "retraction"
    )


def test_a_retraction_its_queue_and_the_evicted_prefix(server):
    server.barrier()
    assert server.debug()["scheduler"]["kv_total"] == POOL  # the pool the streams must outgrow
    r = generate(server, PROMPT, 2)  # an idle engine admits it at the next step; its prefix is cached
    assert r.status_code == 200, r.text
    first, spans = summary(server, r.headers["x-request-id"])
    assert set(first["wait_ms"]) == {"next_step"}, first
    sums_to_queue(first)
    assert first_prefill(spans)["attributes"]["sightline.prefix_cache.miss_reason"] == "never_seen"

    server.barrier()
    retractions = counter(server, "sightline_retractions_total")
    gaps = counter(server, "sightline_decode_gaps_total", cause="retraction")
    held = Stream(server, HELD_PROMPT, HELD_TOKENS, hold=True)  # its prompt evicts PROMPT's unlocked leaf
    server.wait_held(1)
    grower = Stream(server, [7000, 6, 7, 8, 9, 10, 11, 12], GROWER_TOKENS)

    # it runs out of KV beside the held stream (never retracted): retracted, and waits for KV until released
    def retracted() -> bool:
        server.barrier()
        sched = server.debug()["scheduler"]
        return sched["retractions_total"] - retractions == 1 and sched["num_waiting"] == 1

    wait_until(retracted, 30, "the second stream retracted and waiting")
    assert "[DONE]" not in grower.events
    answers: dict = {}  # a long prompt and a short one queue behind it
    big = threading.Thread(target=lambda: answers.setdefault("big", generate(server, BIG, 2)), daemon=True)
    big.start()
    waiting(server, 2)
    behind = threading.Thread(
        target=lambda: answers.setdefault("behind", generate(server, [9000, 1, 2, 3], 4)), daemon=True
    )
    behind.start()
    waiting(server, 3)
    server.release()  # the held stream ends: the retracted one resumes, the long prompt waits for it to end
    for t in (held, grower, big, behind):
        t.join(120)
    assert held.events[-1] == grower.events[-1] == "[DONE]"
    assert held.tokens() == HELD_TOKENS and grower.tokens() == GROWER_TOKENS
    assert answers["big"].status_code == answers["behind"].status_code == 200

    rids = [held.rid, grower.rid, answers["big"].headers["x-request-id"], answers["behind"].headers["x-request-id"]]
    done = {rid: summary(server, rid) for rid in rids}
    for b, _ in done.values():
        sums_to_queue(b)
    assert {rid: b["retractions"] for rid, (b, _) in done.items()} == {rid: int(rid == grower.rid) for rid in rids}
    b, spans = done[grower.rid]
    assert b["wait_ms"].get("retracted", 0) > 0, b
    assert retraction_gaps(spans) == 1, spans  # its gap across the retraction, and no other
    assert done[rids[2]][0]["wait_ms"].get("kv_capacity", 0) > 0, done[rids[2]][0]  # the head that did not fit
    assert done[rids[3]][0]["wait_ms"].get("queue_order", 0) > 0, done[rids[3]][0]  # behind it
    server.barrier()  # the counters of every step so far
    assert counter(server, "sightline_retractions_total") - retractions == 1
    assert (
        counter(server, "sightline_decode_gaps_total", cause="retraction") - gaps
        == sum(retraction_gaps(spans) for _, spans in done.values())
        == 1
    )

    before = misses(server)
    again = generate(server, PROMPT, 2)  # the held stream's prompt evicted it (least recently used, unlocked)
    new = generate(server, [30000 + j for j in range(200)], 2)
    for resp, reason in ((again, "evicted"), (new, "never_seen")):
        attrs = first_prefill(summary(server, resp.headers["x-request-id"])[1])["attributes"]
        assert attrs["sightline.prefix_cache.miss_reason"] == reason, attrs
        assert (
            attrs["sightline.prefix_cache.matched_tokens"] == 0 and attrs["sightline.prefix_cache.lookup_tokens"] == 199
        )
        assert "prefix_cache" not in resp.text and "evicted" not in resp.text and "never_seen" not in resp.text
        assert not any("prefix" in k.lower() or "evict" in v for k, v in resp.headers.items())
    attrs = first_prefill(summary(server, again.headers["x-request-id"])[1])["attributes"]
    assert attrs["sightline.prefix_cache.evicted_tokens"] == 192  # its 12 whole blocks, all in the log
    server.barrier()
    assert misses(server) == {**before, "evicted": before["evicted"] + 1, "never_seen": before["never_seen"] + 1}
