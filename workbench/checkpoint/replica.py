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

Sharded state (FSDP2, hsdp, ``--tp``, ``--pp``: DTensor parameters) is held by
no single rank: :func:`keep` says so and recover loads the latest checkpoint.
"""

from __future__ import annotations

from ..messages import KeptState, Restored
from .state import PER_RANK_MARK, CheckpointState, is_per_rank, per_rank_key, set_rng_state

KEPT: dict | None = None  # this rank's state dict, set aside by keep() until share() or drop()


def keep(again: bool = False) -> KeptState | None:
    """Set this rank's prepared state aside; return ``{"step", "replicated", "keys"}``, or
    None when nothing is prepared. ``keys`` leaves out this rank's own entries (its RNG, its
    stream positions), which no other rank has. Objects prepared on an older process group count
    (the group was rebuilt after the failure that made recovery necessary). ``again``: a recover
    that was interrupted set the state aside already (its setup replay may have replaced the
    objects since): that state is the one to keep."""
    global KEPT
    from ..metrics.logger import LOGGER
    from ..rank import STATE, namespace

    if not (again and KEPT is not None):
        rank = STATE.spec.rank if STATE.spec else 0
        state = CheckpointState(namespace(), rank, LOGGER.step, any_generation=True)
        if not any(state.objects.values()):
            KEPT = None
            return None
        KEPT = state.state_dict()
    # a per-rank registered object of a replaced rank died with it: only a checkpoint has it
    replicated = not _has_shards(KEPT) and not any(k.startswith("user/") and is_per_rank(k) for k in KEPT)
    return KeptState(step=int(KEPT["workbench"]["step"]), replicated=replicated,
                     keys=sorted(k for k in KEPT if not is_per_rank(k)))


def share(src: int) -> Restored:
    """Collective: every rank takes rank ``src``'s kept state into its freshly set-up objects.
    Survivors keep their own per-rank entries (RNG, stream positions); a replaced rank takes
    ``src``'s stream positions (ranks take the same number of batches per step) and keeps the
    RNG its setup cells gave it."""
    global KEPT
    import torch.distributed as dist

    from ..metrics.logger import LOGGER
    from ..rank import STATE, namespace

    rank = STATE.spec.rank
    own, KEPT = KEPT, None
    payload = [own if rank == src else None]
    dist.broadcast_object_list(payload, src=src)  # between this fleet's own ranks, in memory
    state = payload[0]
    live = CheckpointState(namespace(), rank, LOGGER.step)
    shared = {key: value for key, value in state.items() if not is_per_rank(key)}
    mine = per_rank_key("", rank)
    for key, value in state.items():
        if key.startswith("data/") and is_per_rank(key):
            own_key = key.rsplit(PER_RANK_MARK, 1)[0] + mine
            shared[own_key] = own[own_key] if own is not None and own_key in own else value
    restored = live.apply(shared)
    if own is not None and f"rng/{rank}" in own:
        set_rng_state(own[f"rng/{rank}"])
        restored.append("rng")
    LOGGER.step = int(state["workbench"]["step"])
    return Restored(step=LOGGER.step, restored=restored)


def drop() -> None:
    """Forget the kept state (recover used the checkpoint instead)."""
    global KEPT
    KEPT = None


def _has_shards(state) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, dict):
        return any(_has_shards(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(_has_shards(v) for v in state)
    return False
