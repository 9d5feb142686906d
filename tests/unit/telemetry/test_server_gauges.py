"""The per-server gauges an inference router reads: one series per server whatever --dp-size,
with the model-server protocol's meaning (a cached prefix no request locks is free KV)."""

from __future__ import annotations

from protocol.io_struct import SchedulerStats
from telemetry.metrics import EngineCollector
from telemetry.stats import EngineView


def rank(r: int, **kw) -> SchedulerStats:
    return SchedulerStats(
        dp_rank=r, **{"num_running": 0, "num_waiting": 0, "kv_used": 0, "kv_reserved": 0, "kv_total": 1000, **kw}
    )


def test_two_ranks_make_one_series_each():
    view = EngineView(
        schedulers=[
            rank(0, num_running=3, num_waiting=2, kv_used=500, prefix_cached_tokens=300, prefix_evictable_tokens=200),
            rank(1, num_running=1, num_waiting=0, kv_used=100, prefix_cached_tokens=100, prefix_evictable_tokens=100),
        ]
    )
    fams = {f.name: f for f in EngineCollector("m", lambda: view).collect()}
    got = {
        name: [(s.labels, s.value) for s in fams[name].samples]
        for name in (
            "sightline_server_num_requests_waiting",
            "sightline_server_num_requests_running",
            "sightline_server_kv_cache_usage_perc",
        )
    }
    assert got == {
        "sightline_server_num_requests_waiting": [({"model_name": "m"}, 2)],
        "sightline_server_num_requests_running": [({"model_name": "m"}, 4)],
        # (500 - 200) + (100 - 100) slots in use, of 2000: the idle rank's warm cache is free
        "sightline_server_kv_cache_usage_perc": [({"model_name": "m"}, 0.15)],
    }
    assert len(fams["sightline_num_requests_running"].samples) == 2  # the per-rank series stay


def test_no_rank_heard_yet_reads_zero():
    assert (EngineView().server_waiting, EngineView().server_running, EngineView().server_kv_usage) == (0, 0, 0.0)
