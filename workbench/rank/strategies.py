"""The Accelerator each rank builds from a cell's :class:`~workbench.options.CellOptions`.

Engine side; its class (:func:`accelerator_class`) instruments what ``prepare`` returns.
"""

from __future__ import annotations

import functools

from workbench.options import CellOptions
from workbench.rank_state import STATE


def build_accelerator(options: CellOptions, device_type: str, nodes: int = 1):
    """Create the ``accelerate.Accelerator`` for ``options`` on this rank.

    Its ``prepare`` also adds workbench's step and communication measurements
    (:mod:`workbench.rank.instrument`; :func:`accelerator_class`). The process group must already exist. accelerate enables FSDP only for
    GPU-like device types and silently wraps DDP on CPU; for ``fsdp`` on CPU
    the state is switched to FSDP explicitly, which accelerate's FSDP2 path
    supports on gloo (parameters become DTensor shards). Every other strategy keeps
    the distributed type accelerate finds (MULTI_CPU, MULTI_GPU), as under ``accelerate launch``.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    from workbench.parallel.data_parallel import data_parallel

    # accelerate keeps process-wide singletons; a new configuration (or a new
    # process group) needs them cleared first.
    AcceleratorState._reset_state(True)
    plugin = data_parallel(options.strategy).accelerate_plugin(options)
    accelerator = accelerator_class()(
        cpu=device_type == "cpu",
        fsdp_plugin=plugin,
        # hsdp casts through FSDP2's MixedPrecisionPolicy (workbench.parallel)
        mixed_precision="no" if options.custom_parallel else options.mixed_precision,
        gradient_accumulation_steps=options.grad_accum,
        # gradients live in DDP's buckets: no copy into them, so workbench's timed
        # (Python) comm hook costs no extra pass over the gradients
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    state = accelerator.state
    if options.mixed_precision == "bf16" and device_type == "cpu":
        _warn_if_bf16_is_emulated(state.process_index)
    if options.custom_parallel:  # workbench.parallel shards or splits the model; accelerate only places it
        from workbench.parallel.plan import ParallelPlan

        plan = ParallelPlan.of(options, state.num_processes, nodes)
        accelerator.workbench_mesh = plan.build_mesh(device_type)
    accelerator.workbench_options = options
    # ddp and none keep accelerate's own distributed type (MULTI_CPU / MULTI_GPU), so the rank is
    # the distributed environment `accelerate launch` gives; `none` only skips wrapping the model
    if plugin is not None and state.distributed_type != DistributedType.FSDP:
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if options.mixed_precision != "no":
            plugin.set_mixed_precision(options.mixed_precision)
        state.fsdp_plugin = plugin
    return accelerator


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX). Without it, torch emulates
    bf16 matmuls: seen 17x slower than fp32 on an AVX2 machine, so ``--mixed-precision bf16``
    pays off on CPU only where this is true."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _warn_if_bf16_is_emulated(rank: int) -> None:
    if STATE.bf16_warned or rank != 0 or cpu_has_native_bf16():
        return
    STATE.bf16_warned = True
    import sys

    print("workbench: this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 mixed precision is emulated "
          "and runs several times slower than fp32; use --mixed-precision no here", file=sys.stderr, flush=True)


@functools.cache
def accelerator_class():
    """``accelerate.Accelerator`` whose ``prepare`` instruments what it returns (made once)."""
    from accelerate import Accelerator

    from workbench.metrics.logger import LOGGER
    from workbench.rank.instrument import instrument

    class WorkbenchAccelerator(Accelerator):
        workbench_options = None  # the cell's CellOptions (set by build_accelerator)
        workbench_mesh = None  # the DeviceMesh of hsdp / --tp / --pp

        def prepare(self, *args, **kwargs):
            options = self.workbench_options
            if options is not None and (options.custom_parallel or options.activation_checkpointing
                                        or self.is_fsdp2):
                args = self._parallelize(args)
            result = super().prepare(*args, **kwargs)
            from workbench.rank_state import STATE

            for obj in result if isinstance(result, (tuple, list)) else (result,):
                instrument(obj, LOGGER, options)
                try:  # bound to this process group: checkpoints skip it once the group is rebuilt
                    obj._workbench_generation = STATE.spec.generation if STATE.spec else None
                except AttributeError:
                    pass
            return result

        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            """``--strategy none`` and workbench's own parallelism: placed, not wrapped (the
            rank stays a distributed environment: gather, samplers and the rest still work)."""
            options = self.workbench_options
            if options is not None and not options.wraps_model:
                evaluation_mode = True  # accelerate's switch for "no DDP wrapper"
            return super().prepare_model(model, device_placement=device_placement,
                                         evaluation_mode=evaluation_mode)

        def _fsdp_unit_kwargs(self) -> dict | None:
            """``fully_shard`` arguments of the blocks, as accelerate's FSDP2 plugin shards the root."""
            if not self.is_fsdp2:
                return None
            from torch.distributed.fsdp import MixedPrecisionPolicy

            plugin = self.state.fsdp_plugin
            return {"reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload,
                    "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}

        def _parallelize(self, args):
            """Models through :func:`workbench.parallel.prepare_model`; optimizers pointed at
            the new parameters (also when model and optimizer come in separate calls)."""
            import torch

            from workbench.parallel.model import prepare_model, swap_optimizer_params

            swapped = self.__dict__.setdefault("_workbench_swapped", {})
            out = []
            for obj in args:
                if isinstance(obj, torch.nn.Module) and not getattr(obj, "_workbench_parallel", False):
                    obj, moved = prepare_model(obj, self.workbench_options, self.workbench_mesh, self.device,
                                               self._fsdp_unit_kwargs())
                    obj._workbench_parallel = True
                    swapped.update(moved)
                out.append(obj)
            for obj in out:
                if isinstance(obj, torch.optim.Optimizer):
                    swap_optimizer_params(obj, swapped)
            return out

    return WorkbenchAccelerator
