"""A cell's parallelism decided once, as torchtitan's ``ParallelDims``: the degree of each
dimension, their product checked against the world, and the device mesh they make."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import OptionsError
from workbench.parallel.data_parallel import data_parallel
from workbench.parallel.options import check_parallel


@dataclass(frozen=True)
class ParallelPlan:
    """How a cell's ``world`` ranks split: data-parallel replicas x data-parallel shards x
    tensor-parallel x pipeline stages (their product is the world)."""

    strategy: str
    replicate: int
    shard: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, options, world: int, nodes: int = 1, backend: str | None = None) -> ParallelPlan:
        """The plan of ``options`` on ``world`` ranks over ``nodes`` hosts; a one-line
        :class:`OptionsError` for flags that do not fit together or the world."""
        check_parallel(options, world, nodes, backend)
        if options.pp > 1:
            plan = cls(options.strategy, 1, 1, pp=options.pp)
        elif options.tp > 1:
            plan = cls(options.strategy, 1, world // options.tp, tp=options.tp)
        else:
            plan = cls(options.strategy, *data_parallel(options.strategy).degrees(world, nodes, options.mesh))
        if plan.ranks != world:
            raise OptionsError(f"--mesh {options.mesh} has {plan.ranks} ranks but the fleet has {world}")
        return plan

    @property
    def ranks(self) -> int:
        return self.replicate * self.shard * self.tp * self.pp

    @property
    def mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """The shape and dimension names of the DeviceMesh workbench builds (hsdp, --tp, --pp);
        None where accelerate's own DDP/FSDP over the whole group is all there is."""
        if self.pp > 1:
            return (self.pp,), ("pp",)
        if self.tp > 1:
            return (self.shard, self.tp), ("dp", "tp")
        if data_parallel(self.strategy).own_mesh:
            return (self.replicate, self.shard), ("replicate", "shard")
        return None

    def build_mesh(self, device_type: str):
        """The DeviceMesh of :attr:`mesh_dims` (None without one)."""
        if self.mesh_dims is None:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_dims
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

