"""The data-parallel strategies of ``--strategy``, one small registered class each.

A strategy says how the data-parallel ranks split (whole replicas, shards, or replicas of
shards), which other flags it goes with, and what accelerate is given for it.
:class:`~workbench.parallel.plan.ParallelPlan` asks it for the degrees,
:func:`~workbench.parallel.options.check_parallel` for what it goes with, and
:func:`workbench.rank.strategies.build_accelerator` for accelerate's plugin. A new strategy
is one more class here (and its name in :data:`workbench.options.Strategy`).
"""

from __future__ import annotations

from typing import ClassVar

from workbench.errors import OptionsError

STRATEGIES: dict[str, type[DataParallel]] = {}


def register(cls: type[DataParallel]) -> type[DataParallel]:
    STRATEGIES[cls.name] = cls
    return cls


def data_parallel(name: str) -> DataParallel:
    """The strategy called ``name``; a one-line :class:`OptionsError` for an unknown one."""
    if name not in STRATEGIES:
        raise OptionsError(f"unknown strategy {name!r}; use one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]()


class DataParallel:
    """A data-parallel strategy: how ``world`` ranks split into replicas x shards."""

    name: ClassVar[str]
    accelerate_wraps: ClassVar[bool] = True
    """accelerate wraps the model itself (DDP or FSDP2) when no --tp/--pp is given."""
    own_mesh: ClassVar[bool] = False
    """workbench builds its device mesh and shards the model on it (accelerate only places it)."""
    takes_comm_hook: ClassVar[bool] = False
    """the gradients go through DDP's buckets, where --comm-hook compresses them"""
    takes_stages: ClassVar[bool] = False
    """--pp can split the model into stages, each whole on its rank"""
    shards_beside_tp: ClassVar[bool] = False
    """with --tp, shards the data-parallel dimension left (FSDP2 on the mesh's dp dimension)"""
    chooses_units: ClassVar[bool] = False
    """--fsdp-wrap chooses its FSDP units"""
    takes_mesh: ClassVar[bool] = False
    """--mesh RxS gives its replicate x shard layout"""

    def degrees(self, world: int, nodes: int, mesh: str | None) -> tuple[int, int]:
        """``(replicate, shard)``: whole replicas, each sharded over ``shard`` ranks."""
        return world, 1

    def accelerate_plugin(self, options):
        """The plugin accelerate is given (None: accelerate's default, DDP or none)."""
        return None


@register
class Ddp(DataParallel):
    """DistributedDataParallel: every rank a whole replica, gradients all-reduced."""

    name = "ddp"
    takes_comm_hook = True
    takes_stages = True


@register
class NoWrap(DataParallel):
    """``none``: every rank a whole replica, the model left unwrapped (the cell syncs, or not)."""

    name = "none"
    accelerate_wraps = False
    takes_stages = True


@register
class Fsdp(DataParallel):
    """FSDP2 over every rank: parameters, gradients and optimizer state sharded."""

    name = "fsdp"
    shards_beside_tp = True
    chooses_units = True

    def degrees(self, world: int, nodes: int, mesh: str | None) -> tuple[int, int]:
        return 1, world

    def accelerate_plugin(self, options):
        if options.custom_parallel:  # with --tp, workbench applies FSDP itself
            return None
        from accelerate.utils import FullyShardedDataParallelPlugin

        return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)


@register
class Hsdp(DataParallel):
    """FSDP2 on a 2-D mesh: sharded inside a group (a node), replicated across groups."""

    name = "hsdp"
    accelerate_wraps = False
    own_mesh = True
    chooses_units = True
    takes_mesh = True

    def degrees(self, world: int, nodes: int, mesh: str | None) -> tuple[int, int]:
        """``--mesh RxS``, or shard inside a node and replicate across nodes."""
        if mesh is None:
            return (nodes, world // nodes) if world % nodes == 0 else (1, world)
        replicate, _, shard = mesh.lower().partition("x")
        return int(replicate), int(shard)
