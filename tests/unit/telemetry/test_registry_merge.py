"""Merging tokenizer workers' registries into one exposition: real prometheus_client
registries, snapshotted through the wire codec, merged and rendered."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.parser import text_string_to_metric_families

from protocol.io_struct import Snapshot
from serving.ipc import Codec
from telemetry.registry_merge import Retired, merge, registry_of, snapshot


def worker_registry(requests: int, in_flight: int, ttft: list[tuple[float, str]]):
    reg = CollectorRegistry()
    Counter("app_requests", "Requests.", ["status"], registry=reg).labels("200").inc(requests)
    Gauge("app_in_flight", "In flight.", registry=reg).set(in_flight)
    h = Histogram("app_ttft_seconds", "TTFT.", buckets=(0.1, 1.0), registry=reg)
    for v, trace in ttft:
        h.observe(v, exemplar={"trace_id": trace})
    return reg


def wire(reg):
    """A snapshot as the hub receives it: encoded and decoded by the message codec."""
    codec = Codec("test")
    return codec.decode(codec.encode(Snapshot(id="x", worker=1, families=snapshot(reg)))).families


def samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_counters_and_histograms_are_summed_and_gauges_kept_per_worker():
    w1 = wire(worker_registry(3, 2, [(0.05, "a" * 32)]))
    w2 = wire(worker_registry(4, 5, [(0.5, "b" * 32), (0.07, "c" * 32)]))
    hub = CollectorRegistry()
    Gauge("app_build_info", "Build.", registry=hub).set(1)
    text = generate_latest(registry_of(merge(snapshot(hub), {1: w1, 2: w2}, Retired()))).decode()
    got = samples(text)
    assert got[("app_requests_total", (("status", "200"),))] == 7
    assert got[("app_in_flight", (("worker", "1"),))] == 2 and got[("app_in_flight", (("worker", "2"),))] == 5
    assert got[("app_ttft_seconds_bucket", (("le", "0.1"),))] == 2
    assert got[("app_ttft_seconds_count", ())] == 3
    assert got[("app_build_info", ())] == 1
    assert text.count("# TYPE app_requests_total counter") == 1


def test_exemplars_survive_the_merge():
    w1 = wire(worker_registry(1, 0, [(0.05, "a" * 32)]))
    w2 = wire(worker_registry(1, 0, [(0.5, "b" * 32)]))
    om = openmetrics_latest(registry_of(merge([], {1: w1, 2: w2}, Retired()))).decode()
    assert 'app_ttft_seconds_bucket{le="0.1"} 1.0 # {trace_id="' + "a" * 32 in om
    assert 'app_ttft_seconds_bucket{le="1.0"} 2.0 # {trace_id="' + "b" * 32 in om


def test_a_hub_family_wins_over_the_workers_copies():
    hub = CollectorRegistry()
    Counter("app_requests", "Requests.", ["status"], registry=hub).labels("200").inc(100)
    w1 = wire(worker_registry(3, 2, []))
    got = samples(generate_latest(registry_of(merge(snapshot(hub), {1: w1}, Retired()))).decode())
    assert got[("app_requests_total", (("status", "200"),))] == 100


def test_a_dead_workers_counters_stay_and_its_gauges_go():
    retired = Retired()
    retired.add(wire(worker_registry(5, 9, [(0.05, "a" * 32)])))
    w2 = wire(worker_registry(2, 1, []))
    got = samples(generate_latest(registry_of(merge([], {2: w2}, retired))).decode())
    assert got[("app_requests_total", (("status", "200"),))] == 7  # never goes backwards
    assert got[("app_ttft_seconds_count", ())] == 1
    assert [k for k in got if k[0] == "app_in_flight"] == [("app_in_flight", (("worker", "2"),))]
