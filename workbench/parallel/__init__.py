"""Parallelism beyond accelerate's DDP/FSDP, from ``%%distributed`` flags.

- ``--comm-hook fp16|bf16|powersgd[:R]``: torch's DDP communication hooks
  (:mod:`.hooks`), timed like the default all-reduce;
- ``--strategy hsdp --mesh RxS``: FSDP2 on a 2-D mesh, replicate x shard;
- ``--tp N``: ``torch.distributed.tensor.parallel`` on a dp x tp mesh (:mod:`.tensor`);
- ``--pp N``: ``torch.distributed.pipelining`` stages and schedules (:mod:`.pipeline`);
- ``--activation-checkpointing``: torch's checkpoint wrapper on each block;
- ``--fsdp-wrap``: which blocks become their own FSDP2 units (:mod:`.fsdp`).

:class:`ParallelPlan` (:mod:`.plan`) decides a cell's degrees and mesh once, from its options
and the world, checked against the rules of :mod:`.options`.

:func:`prepare_model` applies these in ``accelerator.prepare``
(:mod:`workbench.rank.instrument`); accelerate then only places the model,
and wraps optimizers, schedulers and dataloaders as usual.
"""

from workbench.parallel.fsdp import UnshardedPeak, blocks, fsdp_unit_count, fsdp_units
from workbench.parallel.model import prepare_model
from workbench.parallel.plan import ParallelPlan

__all__ = ["ParallelPlan", "UnshardedPeak", "blocks", "fsdp_unit_count", "fsdp_units", "prepare_model"]
