"""Engine side: the time during which this rank's collectives were in flight (:class:`CommClock`).

Fed by :mod:`.instrument` (DDP's own statistics, timed comm hooks, FSDP2's collectives) and
read by the step logger (:mod:`.logger`) at the end of each step.
"""

from __future__ import annotations

import collections
import time
import weakref


class CommClock:
    """Intervals during which collectives were in flight; thread-safe appends."""

    def __init__(self) -> None:
        self._done: collections.deque = collections.deque()
        self._ddp: list = []  # weak references to DDP models timed by their own reducer
        self.launched = 0  # collectives started (part of the rank's heartbeat)
        self.sync_expected = False  # the last DDP forward prepared a gradient all-reduce for its backward

    def add(self, start: float, end: float) -> None:
        self._done.append((start, end))

    def watch_ddp(self, model) -> None:
        """Read ``model``'s communication time from DDP's own runtime statistics."""
        model._set_ddp_runtime_logging_sample_rate(1)
        model._workbench_comm_end = None
        self._ddp.append(weakref.ref(model))

    def watch_sync(self, model) -> None:
        """Note at each forward of DDP ``model`` whether its backward will all-reduce the
        gradients (DDP decides there: not under ``no_sync()`` or ``torch.no_grad()``)."""
        import torch

        def pre_forward(module, _args):
            self.sync_expected = module.require_backward_grad_sync and torch.is_grad_enabled()

        model.register_forward_pre_hook(pre_forward)

    def ddp_syncing(self) -> bool:
        """The last DDP forward's backward all-reduces gradients (DDP then waits for its peers in it)."""
        return self.sync_expected

    def take(self, now: float) -> float:
        """Seconds covered by the intervals finished since the last call."""
        intervals = []
        while self._done:
            intervals.append(self._done.popleft())
        return _union(intervals) + self._take_ddp()

    def _take_ddp(self) -> float:
        total = 0.0
        alive = []
        for ref in self._ddp:
            model = ref()
            if model is None:
                continue
            alive.append(ref)
            data = model.logger._get_ddp_logging_data().ints_map  # 7 µs (the merged dict of strings: 40)
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
