"""Data-parallel rank picking and the front end's view of several engine ranks and of the hub."""

from __future__ import annotations

import asyncio

from protocol.io_struct import DropCount, EngineStatus, Ready, SnapshotReq
from serving.frontend.engine_state import check_available
from serving.frontend.errors import APIError
from serving.frontend.tokenizer_manager.rank_picker import AFFINITY_TOKENS, RankPicker
from serving.frontend.workers.hub_link import HubLink
from telemetry.metrics import Metrics
from telemetry.timeline import Timeline
from tests.unit.serving.frontend.front import Proc, make_front


def test_least_loaded_rank_takes_the_request_and_release_gives_it_back():
    d = RankPicker(2)
    assert [d.pick([1, 2], 100), d.pick([3], 10), d.pick([4], 10)] == [0, 1, 1]
    assert d.load == [100, 20]
    d.release(0, 100)
    assert d.pick([5], 1) == 0 and d.load == [1, 20]


def test_a_shared_prefix_sticks_to_one_rank_while_it_is_nearly_as_idle():
    d = RankPicker(2)
    prefix = list(range(AFFINITY_TOKENS))
    home = d.affinity(prefix + [7])
    assert d.affinity(prefix + [8, 9]) == home  # only the opening tokens count
    picks = [d.pick(prefix + [i], 50) for i in range(3)]
    assert picks[:2] == [home, home]  # the home rank is at most one request busier than the other
    assert picks[2] == 1 - home  # then load wins
    assert d.affine == 2


def test_each_rank_reports_its_own_series_and_their_drops_are_summed():
    f = make_front(dp_size=2)
    f.procs = {"scheduler_dp0": Proc(101), "scheduler_dp1": Proc(103), "detokenizer": Proc(102)}
    f.monitor.expect(f.procs)
    for rank, pid in ((0, 101), (1, 103)):
        f.transport.deliver(Ready(role=f"scheduler_dp{rank}", pid=pid, dp_rank=rank, context_len=256, vocab_size=10))
    assert not f.monitor.all_ready.is_set()
    f.transport.deliver(Ready(role="detokenizer", pid=102))
    assert f.monitor.all_ready.is_set() and f.monitor.engine_ready.context_len == 256
    drop = [DropCount("scheduler", "AbortReq", "finished", 2)]
    f.scheduler_stats(dp_rank=0, num_running=3, stale_drops=drop)
    f.scheduler_stats(dp_rank=1, num_running=4, stale_drops=drop)
    f.exposition()
    assert f.sample("sightline_num_requests_running", model_name="tiny-random", dp_rank="0") == 3
    assert f.sample("sightline_num_requests_running", model_name="tiny-random", dp_rank="1") == 4
    assert (
        f.sample(
            "sightline_stale_messages_dropped_total", component="scheduler", message_type="AbortReq", reason="finished"
        )
        == 4
    )
    assert f.monitor.debug_state(f.tm.counts())["scheduler"]["num_running"] == 7
    f.scheduler_stats(dp_rank=5, num_running=1)  # no such rank: refused, counted
    assert f.transport.codec.undecodable == 1


def test_requests_spread_over_ranks_and_aborts_follow_them():
    async def main():
        f = make_front(dp_size=2)
        f.procs = {"scheduler_dp0": Proc(101), "scheduler_dp1": Proc(103), "detokenizer": Proc(102)}
        f.monitor.expect(f.procs)
        for rank, pid in ((0, 101), (1, 103)):
            f.transport.deliver(
                Ready(role=f"scheduler_dp{rank}", pid=pid, dp_rank=rank, context_len=256, vocab_size=49152)
            )
        f.transport.deliver(Ready(role="detokenizer", pid=102))
        a, b = await f.submit(), await f.submit()
        assert {a.dp_rank, b.dp_rank} == {0, 1} and f.transport.ranks == [a.dp_rank, b.dp_rank]
        f.tm.abort(b.rid, "client_disconnect")
        assert f.transport.sent[-1].rid == b.rid and f.transport.ranks[-1] == b.dp_rank
        assert f.tm.rank_picker.load[b.dp_rank] == 0

    asyncio.run(main())


def test_a_worker_validates_against_the_hubs_status_and_ends_its_requests_on_a_new_generation():
    sent, failures = [], []
    link = HubLink(3, sent.append, Metrics("m"), Timeline(10))
    link.on_failure = failures.append
    try:
        check_available(link, None)
        raise AssertionError("a worker without a status must not take requests")
    except APIError as exc:
        assert exc.status == 503
    ready = [Ready(role="detokenizer", pid=2), Ready(role="scheduler", pid=1, context_len=128, vocab_size=99)]
    link.handle(EngineStatus(generation=0, ready=ready, throughput=12.5))
    ready = check_available(link, None)
    assert ready.context_len == 128 and ready.vocab_size == 99 and link.throughput.rate() == 12.5
    assert link.health(None) == (True, "ok")
    link.handle(EngineStatus(generation=1, failure="scheduler exited", unavailable="engine failure"))
    assert failures == ["scheduler exited"] and link.health(None) == (False, "engine failure")
    link.handle(EngineStatus(generation=1, failure="scheduler exited", unavailable="engine failure"))
    assert failures == ["scheduler exited"]  # once per generation
    link.handle(SnapshotReq(id="q", kind="metrics"))
    assert sent[-1].worker == 3 and any(f.name == "sightline_requests" for f in sent[-1].families)


def test_a_silent_worker_is_killed_once_and_counted_as_stalled(tmp_path):
    import time

    import zmq
    import zmq.asyncio

    from protocol.io_struct import WorkerStats
    from serving.args import ServerArgs
    from serving.frontend.workers.fleet import Worker, WorkerFleet
    from serving.ipc import Codec, Endpoints, make_socket

    class Proc:  # a worker process whose event loop hung: alive, silent
        pid, exitcode, alive, kills = 4242, None, True, 0

        def is_alive(self) -> bool:
            return self.alive

        def kill(self) -> None:
            self.kills += 1

    ctx, endpoints = zmq.asyncio.Context(), Endpoints(str(tmp_path))
    fleet = WorkerFleet(ServerArgs(model="tiny-random", watchdog_timeout=0.2), endpoints, "", ctx, Codec("t"))
    proc = Proc()
    fleet.workers[1] = Worker(1, proc, make_socket(ctx, zmq.PUSH, endpoints.worker_in(1), do_bind=False))
    assert fleet.kill_stalled(time.monotonic() + 10) == []  # not up yet: starting is not stalling
    fleet.heard(WorkerStats(worker=1, pid=4242, in_flight=3))
    assert fleet.kill_stalled(time.monotonic()) == [] and fleet.has_in_flight()
    assert fleet.kill_stalled(time.monotonic() + 1) == [1] and proc.kills == 1
    assert fleet.kill_stalled(time.monotonic() + 2) == [] and proc.kills == 1  # once
    assert fleet.workers[1].cause == "stalled"
    ctx.destroy(linger=0)
