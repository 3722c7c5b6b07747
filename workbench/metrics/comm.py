"""Engine side: the time during which this rank's collectives were in flight (:class:`CommClock`).

Fed by :mod:`workbench.rank.instrument` (DDP's own statistics, timed comm hooks, FSDP2's collectives) and
read by the step logger (:mod:`.logger`) at the end of each step.
"""

from __future__ import annotations

import collections
import time
import weakref

DDP_READ_EVERY_S = 0.02  # reading DDP's statistics right after a step costs ~40 µs (cold maps of strings)


class CommClock:
    """Intervals during which collectives were in flight; thread-safe appends."""

    def __init__(self) -> None:
        self._done: collections.deque = collections.deque()
        self._ddp: list = []  # weak references to DDP models timed by their own reducer
        self.launched = 0  # collectives started (part of the rank's heartbeat)
        self.sync_expected = False  # the last DDP forward prepared a gradient all-reduce for its backward
        self._ddp_read_at = float("-inf")

    def add(self, start: float, end: float) -> None:
        self._done.append((start, end))

    def watch_ddp(self, model) -> None:
        """Read ``model``'s communication time from DDP's own runtime statistics."""
        model._set_ddp_runtime_logging_sample_rate(1)
        model._workbench_comm_end = None
        self._ddp.append(weakref.ref(model))

    def ddp_syncing(self) -> bool:
        """The last DDP forward's backward all-reduces gradients (DDP then waits for its peers in it)."""
        return self.sync_expected

    def take(self, now: float) -> float | None:
        """Seconds covered by the intervals finished since the last call; None when a DDP
        model's figure was read less than ``DDP_READ_EVERY_S`` ago (steps that short get
        it every few steps: the reading would cost them more than 1 %)."""
        if not self._ddp:  # the common case on a step without DDP: nothing to read but the intervals
            return _union(self._take_done()) if self._done else 0.0
        if now - self._ddp_read_at < DDP_READ_EVERY_S:
            self._done.clear()
            return None
        self._ddp_read_at = now
        return _union(self._take_done()) + self._take_ddp()

    def _take_done(self) -> list:
        intervals = []
        while self._done:
            intervals.append(self._done.popleft())
        return intervals

    def restart(self) -> None:
        """Forget what ran so far (a new cell, the end of a trial); the next step reads DDP's figure."""
        self._done.clear()
        self._take_ddp()
        self._ddp_read_at = float("-inf")

    def _take_ddp(self) -> float:
        total = 0.0
        alive = []
        for ref in self._ddp:
            model = ref()
            if model is None:
                continue
            alive.append(ref)
            data = model.logger._get_ddp_logging_data().ints_map  # not DDP's Python method: it merges in the strings too
            end = data.get("backward_comm_time_end")
            if end is not None and end != model._workbench_comm_end:  # a backward not counted yet
                model._workbench_comm_end = end
                total += data.get("backward_comm_time", 0) / 1e9
        self._ddp = alive
        return total

    def timed(self, launch, *args, **kwargs):
        """Run ``launch`` (a collective); time it until its Work (if async) completes."""
        start = time.perf_counter()
        self.launched += 1
        work = launch(*args, **kwargs)
        if work is None:
            self.add(start, time.perf_counter())
            return None
        work.get_future().then(lambda _f: self.add(start, time.perf_counter()))
        return work


def _union(intervals: list) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total
