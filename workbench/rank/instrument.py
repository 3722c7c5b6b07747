"""Engine side: built-in measurements of prepared models and optimizers.

``accelerator.prepare`` returns objects that workbench instruments, so a
training loop reports step time, throughput and communication time without
user code:

- DDP: with no ``--comm-hook``, DDP's own runtime statistics (its C++ reducer
  times each backward's communication; sampled every step, read at most every 20 ms,
  so steps shorter than that carry the figure every few steps), because any Python
  comm hook, even torch's ``allreduce_hook``, costs an extra pass over the
  gradients (the division the reducer otherwise fuses into its bucket copy: ~2 %
  of a 40 ms step here); with ``--comm-hook`` (:mod:`workbench.parallel.hooks`),
  a wrapper that times each bucket's communication from launch to completion of
  its future;
- FSDP2: the all-gather and reduce-scatter of every FSDP module wrapped the
  same way (FSDP2's documented custom-comm extension point); HSDP's all-reduce across
  replicas (often the one across hosts) has no such point: FSDP2's collectives module
  gets a view of ``torch.distributed`` whose ``all_reduce`` is timed;
- the model's forward counts samples (the first dimension of its first tensor);
- the optimizer's step marks the end of a training step;
- a dataloader keeps its exact position in its data (:mod:`workbench.data_position`).

Communication time is the union of those intervals (buckets overlap), so it is
the wall time during which at least one collective was in flight. DDP's own
figure is the same span (first bucket launched to last bucket done), reported at
the next forward, so a step's record carries the previous backward's figure.
"""

from __future__ import annotations

import time

from workbench.data_position import track
from workbench.metrics.comm import CommClock


def _timed_comm_hook(clock: CommClock, inner):
    """A DDP comm hook that runs torch's ``inner`` hook and times it until its future is done."""

    def hook(state, bucket):
        start = time.perf_counter()
        clock.launched += 1

        def done(fut):
            clock.add(start, time.perf_counter())
            return fut.value()

        return inner(state, bucket).then(done)

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

    _time_hsdp_all_reduce(clock)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if not isinstance(group._all_gather_comm, TimedAllGather):
                group._all_gather_comm = TimedAllGather(group._all_gather_comm)
                group._reduce_scatter_comm = TimedReduceScatter(group._reduce_scatter_comm)


class _TimedAllReduce:
    """``torch.distributed`` as FSDP2's collectives module sees it, with ``all_reduce`` timed."""

    def __init__(self, inner, clock: CommClock) -> None:
        self._inner, self._clock = inner, clock

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def all_reduce(self, *args, **kwargs):
        return self._clock.timed(self._inner.all_reduce, *args, **kwargs)


def _time_hsdp_all_reduce(clock: CommClock) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    if not isinstance(_fsdp_collectives.dist, _TimedAllReduce):
        _fsdp_collectives.dist = _TimedAllReduce(_fsdp_collectives.dist, clock)


def _before_forward(logger, ddp: bool):
    """A forward pre-hook that counts samples and, on a DDP model (``ddp``), notes whether its
    backward will all-reduce the gradients (DDP decides in its forward: not under
    ``no_sync()`` or ``torch.no_grad()``); the heartbeat then knows a wait in backward is one."""
    import torch

    def hook(module, args, kwargs):
        if ddp:
            logger.comm.sync_expected = module.require_backward_grad_sync and torch.is_grad_enabled()
        for value in (*args, *kwargs.values()):
            shape = getattr(value, "shape", None)
            if shape is not None and len(shape) > 0:
                logger.samples_seen(int(shape[0]))
                return

    return hook


def instrument(obj, logger, options=None) -> None:
    """Add workbench's measurements to one object returned by ``accelerator.prepare``."""
    if getattr(obj, "_workbench_instrumented", False):
        return
    import torch

    if isinstance(obj, torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        hook = options.comm_hook if options is not None else None
        ddp = isinstance(obj, DistributedDataParallel)
        if ddp:
            if obj._comm_hooks:
                pass  # the user's own hook: left alone, not timed
            elif hook is None:
                logger.comm.watch_ddp(obj)
            else:
                from workbench.parallel.hooks import comm_hook

                state, inner = comm_hook(hook)
                obj.register_comm_hook(state, _timed_comm_hook(logger.comm, inner))
        elif isinstance(obj, FSDPModule):
            _wrap_fsdp_comms(obj, logger.comm)
        obj.register_forward_pre_hook(_before_forward(logger, ddp), with_kwargs=True)
    elif hasattr(obj, "optimizer") and isinstance(obj.optimizer, torch.optim.Optimizer):
        # accelerate's optimizer wrapper skips the inner step while accumulating
        obj.optimizer.register_step_post_hook(lambda *_: logger.optimizer_stepped())
        logger.optimizer_prepared()
    elif isinstance(obj, torch.utils.data.DataLoader):
        track(obj)
    else:
        return
    try:
        obj._workbench_instrumented = True
    except AttributeError:
        pass
