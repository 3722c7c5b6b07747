"""Engine side: built-in measurements of prepared models and optimizers.

``accelerator.prepare`` returns objects that workbench instruments, so a
training loop reports step time, throughput and communication time without
user code:

- DDP: a comm hook that wraps torch's own ``allreduce_hook`` and times each
  bucket's all-reduce from launch to completion of its future;
- FSDP2: the all-gather and reduce-scatter of every FSDP module wrapped the
  same way (FSDP2's documented custom-comm extension point);
- the model's forward counts samples (the first dimension of its first tensor);
- the optimizer's step marks the end of a training step;
- a dataloader counts the batches of the current pass (its position in checkpoints).

Communication time is the union of those intervals (buckets overlap), so it is
the wall time during which at least one collective was in flight.
"""

from __future__ import annotations

import collections
import time


class CommClock:
    """Intervals during which collectives were in flight; thread-safe appends."""

    def __init__(self) -> None:
        self._done: collections.deque = collections.deque()
        self.launched = 0  # collectives started (part of the rank's heartbeat)

    def add(self, start: float, end: float) -> None:
        self._done.append((start, end))

    def take(self, now: float) -> float:
        """Seconds covered by the intervals finished since the last call."""
        intervals = []
        while self._done:
            intervals.append(self._done.popleft())
        total, reach = 0.0, float("-inf")
        for start, end in sorted(intervals):
            if end <= reach:
                continue
            total += end - max(start, reach)
            reach = end
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


def _timed_allreduce_hook(clock: CommClock):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(process_group, bucket):
        start = time.perf_counter()
        clock.launched += 1

        def done(fut):
            clock.add(start, time.perf_counter())
            return fut.value()

        return allreduce_hook(process_group, bucket).then(done)

    return hook


def _wrap_fsdp_comms(model, clock: CommClock) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class Timed:
        """Delegates to FSDP's own comm object, timing each call."""

        def __init__(self, inner):
            self.inner = inner

        def allocate(self, *args, **kwargs):
            return self.inner.allocate(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            return clock.timed(self.inner, *args, **kwargs)

    class TimedAllGather(Timed, AllGather):
        pass

    class TimedReduceScatter(Timed, ReduceScatter):
        pass

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if not isinstance(group._all_gather_comm, TimedAllGather):
                group._all_gather_comm = TimedAllGather(group._all_gather_comm)
                group._reduce_scatter_comm = TimedReduceScatter(group._reduce_scatter_comm)


def _count_samples(logger):
    def hook(_module, args, kwargs):
        for value in (*args, *kwargs.values()):
            shape = getattr(value, "shape", None)
            if shape is not None and len(shape) > 0:
                logger.samples_seen(int(shape[0]))
                return

    return hook


def _track_position(loader) -> None:
    """Count the batches a prepared dataloader has yielded in the current pass (its
    position in checkpoints); ``loader.skip_batches`` set by a restore lasts one pass.

    accelerate's DataLoaderShard calls ``_update_state_dict`` once per batch, and
    ``begin``/``end`` around each pass; instance attributes wrap those three.
    """
    if not all(hasattr(loader, name) for name in ("_update_state_dict", "begin", "end", "skip_batches")):
        return
    update, begin, end = loader._update_state_dict, loader.begin, loader.end
    base_skip = loader.skip_batches

    def counting_update():
        loader._workbench_batches += 1
        update()

    def counting_begin():
        loader._workbench_batches = 0
        begin()

    def counting_end():
        loader._workbench_batches = 0
        loader.skip_batches = base_skip
        end()

    loader._workbench_batches = 0
    loader._update_state_dict, loader.begin, loader.end = counting_update, counting_begin, counting_end


def instrument(obj, logger) -> None:
    """Add workbench's measurements to one object returned by ``accelerator.prepare``."""
    if getattr(obj, "_workbench_instrumented", False):
        return
    import torch

    if isinstance(obj, torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(obj, DistributedDataParallel) and not obj._comm_hooks:
            obj.register_comm_hook(None, _timed_allreduce_hook(logger.comm))
        elif isinstance(obj, FSDPModule):
            _wrap_fsdp_comms(obj, logger.comm)
        obj.register_forward_pre_hook(_count_samples(logger), with_kwargs=True)
    elif hasattr(obj, "optimizer") and isinstance(obj.optimizer, torch.optim.Optimizer):
        # accelerate's optimizer wrapper skips the inner step while accumulating
        obj.optimizer.register_step_post_hook(lambda *_: logger.optimizer_stepped())
    elif isinstance(obj, torch.utils.data.DataLoader):
        _track_position(obj)
    else:
        return
    try:
        obj._workbench_instrumented = True
    except AttributeError:
        pass


def accelerator_class():
    """``accelerate.Accelerator`` whose ``prepare`` instruments what it returns."""
    global _ACCELERATOR_CLASS
    if _ACCELERATOR_CLASS is None:
        from accelerate import Accelerator

        from .logger import LOGGER

        class WorkbenchAccelerator(Accelerator):
            def prepare(self, *args, **kwargs):
                result = super().prepare(*args, **kwargs)
                for obj in result if isinstance(result, (tuple, list)) else (result,):
                    instrument(obj, LOGGER)
                return result

        _ACCELERATOR_CLASS = WorkbenchAccelerator
    return _ACCELERATOR_CLASS


_ACCELERATOR_CLASS = None
