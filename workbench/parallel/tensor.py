"""``--tp N``: tensor parallelism with ``torch.distributed.tensor.parallel`` on a dp x tp mesh.

The plan comes from the model's ``tp_plan`` attribute (``{submodule name:
"colwise" | "rowwise" | a ParallelStyle}``, as :mod:`workbench.models` provides),
or, for an ``nn.Sequential``, from its ``nn.Linear`` layers taken in pairs:
the first of a pair column-wise, the second row-wise (Megatron's MLP split: one
all-reduce per pair); an unpaired last Linear stays replicated. With a
data-parallel dimension larger than 1, FSDP2 then shards over ``mesh["dp"]``
(:mod:`.model`).
"""

from __future__ import annotations


def plan_for(model) -> dict:
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = getattr(model, "tp_plan", None)
    if plan is None and isinstance(model, torch.nn.Sequential):
        linears = [name for name, m in model.named_children() if isinstance(m, torch.nn.Linear)]
        plan = {}
        for first, second in zip(linears[0::2], linears[1::2], strict=False):
            plan[first], plan[second] = "colwise", "rowwise"
    if not plan:
        raise ValueError("--tp needs a plan: give the model a tp_plan attribute ({submodule: 'colwise' | "
                         "'rowwise'}), or make it an nn.Sequential with pairs of nn.Linear layers")
    return {name: styles[style]() if isinstance(style, str) else style for name, style in plan.items()}


def tensor_parallel(model, mesh) -> None:
    """Shard the planned layers over ``mesh["tp"]`` (FSDP over ``mesh["dp"]`` comes after)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], plan_for(model))
