"""Shard, split or checkpoint a model as a cell's parallelism flags ask, on every rank."""

from __future__ import annotations

import weakref

from workbench.parallel.data_parallel import data_parallel

CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def checkpoint_activations(model) -> int:
    """Recompute each block's activations in backward (torch's checkpoint wrapper); returns how many."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from workbench.parallel.fsdp import blocks

    chosen = {id(b) for b in blocks(model)}
    if not chosen:
        raise ValueError("--activation-checkpointing found no blocks to wrap: give the model an nn.ModuleList of "
                         "layers, or make it an nn.Sequential")
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in chosen)
    return len(chosen)


def _hsdp(model, mesh, mixed_precision: str, wrap: str) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from workbench.parallel.fsdp import shard_units

    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_units(model, wrap, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def prepare_model(model, options, mesh, device, fsdp_unit_kwargs: dict | None = None):
    """Apply ``--tp``, ``--activation-checkpointing``, then hsdp / FSDP over tp's dp / ``--pp``
    / the blocks of ``--strategy fsdp`` (``fsdp_unit_kwargs``: accelerate shards the root after)
    (torchtitan's order) to ``model``. Returns the model to use (for --pp, this rank's
    stage) and ``{id(old parameter): new parameter, or None when it lives on another
    stage}`` (with a weak reference to the old one) for optimizers built before."""
    from torch.distributed.fsdp import fully_shard

    before = {name.replace(CHECKPOINT_PREFIX, ""): p for name, p in model.named_parameters()}
    if options.tp > 1:
        from workbench.parallel.tensor import tensor_parallel

        tensor_parallel(model, mesh)
    if options.activation_checkpointing:
        checkpoint_activations(model)
    if data_parallel(options.strategy).own_mesh:
        _hsdp(model, mesh, options.mixed_precision, options.fsdp_wrap)
    elif options.tp > 1 and mesh["dp"].size() > 1:
        fully_shard(model, mesh=mesh["dp"])
    elif fsdp_unit_kwargs is not None:
        from workbench.parallel.fsdp import shard_units

        shard_units(model, options.fsdp_wrap, **fsdp_unit_kwargs)
    elif options.pp > 1:
        from workbench.parallel.pipeline import PipelinedModel

        model = PipelinedModel(model, options, mesh, device)
    after = {name.replace(CHECKPOINT_PREFIX, "").removeprefix("stage."): p for name, p in model.named_parameters()}
    return model, {id(p): (weakref.ref(p), after.get(name)) for name, p in before.items()}


def swap_optimizer_params(optimizer, swapped: dict) -> None:
    """Point an optimizer built on the original parameters at the prepared ones (drop
    those that went to another pipeline stage). ``swapped``: from :func:`prepare_model`;
    its weak references make sure an id is not that of a parameter since freed."""

    def new(p):
        ref, replacement = swapped.get(id(p), (None, p))
        return replacement if ref is None or ref() is p else p

    for group in optimizer.param_groups:
        group["params"] = [new(p) for p in group["params"] if new(p) is not None]
