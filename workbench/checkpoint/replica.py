"""Engine side: recovery from a live replica (used by ``%fleet recover``).

With DDP, or with no wrapping, every rank holds the whole model, optimizer and
scheduler state. When ranks are replaced, each survivor first sets its state
aside (:func:`keep`: references to the old objects' tensors, no copy); the
setup cells are then replayed on every rank, and one survivor sends its state
to every rank over the new group (:func:`share`). The work lost is the step in
flight, not a checkpoint interval, and the data goes on exactly where that step left it
(:mod:`workbench.data_position`). Any number of survivors works: they agree on the shared
state (the one with the most completed steps sends it), each keeps its own RNG state; a
replaced rank's RNG state died with it (it has its setup cells' seed).

Sharded state (DTensor parameters) is held by no single rank, but its shards may have
replicas: with hsdp every shard group holds the whole model, so a rank's shard lives on in the
rank at the same place of another group. :func:`holding` names the shard a rank holds (its
coordinates on the mesh's sharded dimensions); :func:`share` sends each survivor's shard to the
ranks that hold the same one after the replay. Where some shard has no survivor (FSDP, --tp,
both copies of an hsdp shard lost), recover loads the latest checkpoint.
"""

from __future__ import annotations

import math

from workbench.checkpoint.state import PER_RANK_MARK, CheckpointState, is_per_rank, per_rank_key, set_rng_state
from workbench.messages import KeptState, Restored


def keep(again: bool = False) -> KeptState | None:
    """Set this rank's prepared state aside; return ``{"step", "replicated", "keys"}``, or
    None when nothing is prepared. ``keys`` leaves out this rank's own entries (its RNG, its
    stream positions), which no other rank has. Objects prepared on an older process group count
    (the group was rebuilt after the failure that made recovery necessary). ``again``: a recover
    that was interrupted set the state aside already (its setup replay may have replaced the
    objects since): that state is the one to keep."""
    from workbench.metrics.logger import LOGGER
    from workbench.rank_state import STATE, namespace

    rank = STATE.spec.rank if STATE.spec else 0
    if not (again and STATE.kept_state is not None):
        state = CheckpointState(namespace(), rank, LOGGER.step, any_generation=True)
        if not any(state.objects.values()):
            STATE.kept_state = None
            return None
        STATE.kept_state, STATE.kept_holds = state.state_dict(), _holding(state.objects["model"])
    kept, holds = STATE.kept_state, STATE.kept_holds
    # a per-rank registered object of a replaced rank died with it: only a checkpoint has it
    per_rank_objects = any(k.startswith("user/") and is_per_rank(k) for k in kept)
    whole = holds is not None and (holds or not _has_shards(kept))  # no other DTensors
    shards = max((math.prod(shape[d] for d in sharded_dims) for _, shape, _, sharded_dims in holds or ()),
                 default=1)
    return KeptState(step=int(kept["workbench"]["step"]), replicated=bool(whole) and not per_rank_objects,
                     keys=sorted(k for k in kept if not is_per_rank(k)), holds=holds or None, shards=shards)


def holding() -> list | None:
    """After the setup replay: which shard this rank's freshly prepared models hold (None: the
    whole state; ``[]`` when it is sharded in a way no other rank shares)."""
    from workbench.rank_state import STATE, namespace

    holds = _holding(CheckpointState(namespace(), STATE.spec.rank, 0).objects["model"])
    return holds or None if holds is not None else []


def _holding(models: dict) -> list | None:
    """For each model with DTensor parameters: its name, the mesh's shape and this rank's
    coordinates on the dimensions where a parameter is sharded (two ranks with equal values hold
    equal shards). ``[]`` for no DTensors; None when parameters of one model lie on different
    meshes or placements (a layout this does not follow)."""
    from torch.distributed.tensor import DTensor

    holds = []
    for name, model in sorted(models.items()):
        layouts = {(tuple(p.device_mesh.shape), tuple(p.device_mesh.get_coordinate() or ()),
                    tuple(not pl.is_replicate() for pl in p.placements))
                   for p in model.parameters() if isinstance(p, DTensor)}
        if len(layouts) > 1:
            return None
        for shape, coordinate, sharded in layouts:
            dims = [d for d, s in enumerate(sharded) if s]
            holds.append([name, list(shape), [coordinate[d] for d in dims], dims])
    return holds


def share(sources: list) -> Restored:
    """Collective: every rank takes the kept state of the survivor that holds what it holds now,
    into its freshly set-up objects. ``sources``: ``[holds, rank]`` pairs (``holds`` None: the whole
    state, one source for all). Survivors keep their own per-rank entries (RNG, stream
    positions); a replaced rank takes its source's stream positions (ranks take the same number
    of batches per step) and keeps the RNG its setup cells gave it."""
    import torch.distributed as dist

    from workbench.metrics.logger import LOGGER
    from workbench.rank_state import STATE, namespace

    rank = STATE.spec.rank
    own, STATE.kept_state = STATE.kept_state, None
    held_here = holding()
    state = None
    for holds, src in sources:
        payload = [_local_shards(own) if rank == src else None]
        dist.broadcast_object_list(payload, src=src)  # between this fleet's own ranks, in memory
        if holds == held_here:
            state = payload[0]
    if state is None:
        raise RuntimeError(f"no survivor holds the shard rank {rank} holds ({held_here})")
    live = CheckpointState(namespace(), rank, LOGGER.step)
    shared = {key: value for key, value in state.items() if not is_per_rank(key)}
    mine = per_rank_key("", rank)
    for key, value in state.items():
        if key.startswith("data/") and is_per_rank(key):
            own_key = key.rsplit(PER_RANK_MARK, 1)[0] + mine
            shared[own_key] = own[own_key] if own is not None and own_key in own else value
    restored = live.apply(_into_live(live, shared) if held_here else shared)
    if own is not None and f"rng/{rank}" in own:
        set_rng_state(own[f"rng/{rank}"])
        restored.append("rng")
    LOGGER.step = int(state["workbench"]["step"])
    return Restored(step=LOGGER.step, restored=restored)


def drop() -> None:
    """Forget the kept state (recover used the checkpoint instead)."""
    from workbench.rank_state import STATE

    STATE.kept_state = None


def _local_shards(state):
    """``state`` with each DTensor as its local shard (its mesh belongs to the old process group)."""
    from torch.distributed.tensor import DTensor

    if not _has_shards(state):
        return state
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _local_shards(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_local_shards(v) for v in state)
    return state


def _into_live(live: CheckpointState, received: dict) -> dict:
    """This rank's live state (DTensors on the new mesh) holding ``received``'s values, each local
    shard copied into the live DTensor's own (as a checkpoint load fills its template)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element  # the helpers DCP's own load uses
    from torch.distributed.tensor import DTensor

    template = live.template(set(received))
    flat, mapping = flatten_state_dict(template)
    values, _ = flatten_state_dict(received)
    for key, value in flat.items():
        if key not in values:
            continue
        if isinstance(value, DTensor):
            value.to_local().copy_(values[key])
        elif isinstance(value, torch.Tensor):
            value.copy_(values[key])
        else:
            set_element(template, mapping[key], values[key])
    return template


def _has_shards(state) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(_has_shards(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(_has_shards(v) for v in state)
    return False
