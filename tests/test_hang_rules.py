"""The kernel's hang rules (:mod:`workbench.kernel.watchdog`) on heartbeats made by hand (no fleet)."""

from __future__ import annotations

from types import SimpleNamespace

from workbench.kernel import watchdog
from workbench.kernel.metrics.store import MetricsStore, RankStream


def _watch(streams: dict[int, RankStream]) -> watchdog.HangWatch:
    store = MetricsStore()
    store.streams.update(streams)
    members = {rank: SimpleNamespace(pid=stream.pid) for rank, stream in streams.items()}
    fleet = SimpleNamespace(metrics=SimpleNamespace(store=store), member=members.__getitem__)
    return watchdog.HangWatch(fleet, sorted(streams), timeout=300.0)


def _waiting(pid: int, waiting_s: float, beat_at: float) -> RankStream:
    return RankStream(pid=pid, cell=1, beat_at=beat_at, waiting_in="backward (DDP's gradient all-reduce)",
                      waiting_s=waiting_s)


def test_a_long_collective_is_a_mismatch_only_after_its_peer_has_been_gone_a_while(monkeypatch):
    """Was: ranks 0 and 1 had waited 4.5 s in one backward's all-reduce over a thin link when
    rank 2 finished the cell, so half a second later they were called stuck. Now the clock also
    starts when the peer finished."""
    now = [1000.0]
    monkeypatch.setattr(watchdog.time, "time", lambda: now[0])
    watch = _watch({0: _waiting(10, 4.5, 1000.0), 1: _waiting(11, 4.5, 1000.0)})
    now[0] += 0.6
    assert watch.mismatched([0, 1], [2]) == []  # waited 5.1 s in the collective, the peer gone 0 s
    now[0] += 3.0
    assert watch.mismatched([0, 1], [2]) == []  # the peer gone 3 s
    now[0] += 2.5
    hangs = watch.mismatched([0, 1], [2])
    assert [h.rank for h in hangs] == [0, 1] and all(h.ename == "MismatchedCollective" for h in hangs)
    assert "waited 11 s in backward (DDP's gradient all-reduce) while rank 2 had already finished" in hangs[0].text()


def test_a_rank_whose_collective_still_moves_is_not_a_mismatch(monkeypatch):
    """A rank's wait restarts while bytes flow (its heartbeat's waiting_s stays small): however
    long the peer has been gone, no mismatch while one pending rank still makes progress."""
    now = [1000.0]
    monkeypatch.setattr(watchdog.time, "time", lambda: now[0])
    streams = {0: _waiting(10, 30.0, 1000.0), 1: _waiting(11, 0.5, 1000.0)}
    watch = _watch(streams)
    assert watch.mismatched([0, 1], [2]) == []
    now[0] += 20.0
    streams[1].waiting_s, streams[1].beat_at = 0.5, now[0]
    assert watch.mismatched([0, 1], [2]) == []
    assert watch.mismatched([0, 1], []) == []  # nobody finished: no mismatch rule at all
