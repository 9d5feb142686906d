"""Why it waited and why it missed the cache when KV runs out, on one real tiny-random server with a KV pool
the running streams outgrow: a retraction (the retracted stream waited `retracted`; its gap's cause: retraction),
a long prompt that does not fit beside them (kv_capacity) and a request queued behind it (queue_order), a
request on an idle engine (next_step); every request's reasons sum to its queue time, and the counters move by
exactly what those requests went through.
A prompt the streams pushed out of the prefix cache misses as `evicted` (where its match ended, how much had
been evicted), a new one as `never_seen` — in its prefill span and the counter, never in the response."""

from __future__ import annotations

import threading

import pytest

from tests.e2e.test_why_slow import Stream, counter, entry, generate
from tests.server_util import ServerProc, wait_until

POOL = 1536  # KV slots: four streams of 8 + 1000 tokens need 4032
STREAMS, STREAM_TOKENS = 4, 1000  # long enough to be running still when the long prompt arrives, on a busy machine too
PROMPT = [100 + j % 500 for j in range(200)]  # one leaf of 200 + 1 computed positions once it has run
BIG = [20000 + j for j in range(1400)]  # fits the empty pool, not beside four streams of 40+ tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProc("--max-total-tokens", str(POOL), "--max-running-requests", "8",
                     "--max-prefill-tokens", "1024", "--max-step-tokens", "1024",
                     "--init-new-token-ratio", "0.05",  # admit all four: the estimate is far below what they grow to
                     "--decode-gap-factor", "3", "--decode-gap-floor", "0.005", "--heartbeat-interval", "0.2",
                     tmpdir=tmp_path_factory.mktemp("why-kv"))
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
    return {r: counter(srv, "sightline_prefix_cache_misses_total", reason=r)
            for r in ("evicted", "never_seen", "too_short")}


def test_a_retraction_its_queue_and_the_evicted_prefix(server):
    sched = wait_until(lambda: server.debug()["scheduler"], 30, "the Scheduler's stats")
    assert sched["kv_total"] == POOL  # the pool the streams must outgrow
    r = generate(server, PROMPT, 2)  # an idle engine admits it at the next step; its prefix is cached
    assert r.status_code == 200, r.text
    first, spans = summary(server, r.headers["x-request-id"])
    assert set(first["wait_ms"]) == {"next_step"}, first
    sums_to_queue(first)
    assert first_prefill(spans)["attributes"]["sightline.prefix_cache.miss_reason"] == "never_seen"

    retractions = counter(server, "sightline_retractions_total")
    gaps = counter(server, "sightline_decode_gaps_total", cause="retraction")
    streams = [Stream(server, [7000 + i, 6, 7, 8, 9, 10, 11, 12], STREAM_TOKENS) for i in range(STREAMS)]
    wait_until(lambda: all(len(s.events) >= 30 for s in streams), 120, "the streams holding over 150 slots")
    answers: dict = {}  # a long prompt that cannot fit beside them waits for KV until they end; one more behind it
    big = threading.Thread(target=lambda: answers.setdefault("big", generate(server, BIG, 2)), daemon=True)
    big.start()
    wait_until(lambda: server.debug()["scheduler"]["num_waiting"] >= 1, 30, "the long prompt waiting for KV")
    behind = generate(server, [9000, 1, 2, 3], 4)
    big.join(300)
    for s in streams:
        s.join(300)
    assert all(s.events[-1] == "[DONE]" and len(s.events) > STREAM_TOKENS // 2 for s in streams)
    assert counter(server, "sightline_retractions_total") > retractions  # the streams outgrew the pool

    rids = [s.rid for s in streams] + [answers["big"].headers["x-request-id"], behind.headers["x-request-id"]]
    done = {rid: summary(server, rid) for rid in rids}
    for b, _ in done.values():
        sums_to_queue(b)
    retracted = [rid for rid, (b, _) in done.items() if b["retractions"]]
    assert retracted, {rid: b for rid, (b, _) in done.items()}
    for rid in retracted:
        b, spans = done[rid]
        assert b["wait_ms"].get("retracted", 0) > 0, b
        decode = next(s for s in spans if s["name"] == "decode")
        assert any(e["name"] == "decode_gap" and e["attributes"]["sightline.decode_gap.cause"] == "retraction"
                   for e in decode["events"]), decode["events"]
    assert done[rids[-2]][0]["wait_ms"].get("kv_capacity", 0) > 0, done[rids[-2]][0]  # the head that did not fit
    assert done[rids[-1]][0]["wait_ms"].get("queue_order", 0) > 0, done[rids[-1]][0]  # behind it
    caused = sum(1 for _, spans in done.values() for s in spans if s["name"] == "decode" for e in s["events"]
                 if e["name"] == "decode_gap" and e["attributes"]["sightline.decode_gap.cause"] == "retraction")
    wait_until(lambda: counter(server, "sightline_retractions_total") - retractions
               == sum(b["retractions"] for b, _ in done.values()), 10, "the retraction counter to match")
    wait_until(lambda: counter(server, "sightline_decode_gaps_total", cause="retraction") - gaps == caused, 10,
               "the retraction gaps counted exactly")

    before = misses(server)
    again = generate(server, PROMPT, 2)  # the streams evicted it (least recently used, unpinned)
    new = generate(server, [30000 + j for j in range(200)], 2)
    for resp, reason in ((again, "evicted"), (new, "never_seen")):
        attrs = first_prefill(summary(server, resp.headers["x-request-id"])[1])["attributes"]
        assert attrs["sightline.prefix_cache.miss_reason"] == reason, attrs
        assert attrs["sightline.prefix_cache.matched_tokens"] == 0 and attrs["sightline.prefix_cache.lookup_tokens"] \
            == 199
        assert "prefix_cache" not in resp.text and "evicted" not in resp.text and "never_seen" not in resp.text
        assert not any("prefix" in k.lower() or "evict" in v for k, v in resp.headers.items())
    attrs = first_prefill(summary(server, again.headers["x-request-id"])[1])["attributes"]
    assert attrs["sightline.prefix_cache.evicted_tokens"] == 192  # its 12 whole blocks, all in the log
    wait_until(lambda: misses(server) == {**before, "evicted": before["evicted"] + 1,
                                          "never_seen": before["never_seen"] + 1}, 10, "one miss of each")
