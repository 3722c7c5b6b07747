"""What a checkpoint holds, on one rank, and how it is put back.

Everything that ``accelerator.prepare`` returned and that is bound to a name
in the rank's namespace, under that name: models and their optimizers
(through ``torch.distributed.checkpoint.state_dict``, so FSDP2 state stays
sharded: each rank saves its own shard), schedulers, dataloader positions;
plus this rank's RNG states, ``workbench.step`` and the objects registered with
``workbench.checkpoint.register``.
"""

from __future__ import annotations

import random
import sys

from workbench.errors import CheckpointError

REGISTERED: dict[str, tuple[object, bool]] = {}  # name -> (object, per rank)


def prepared_objects(namespace: dict, any_generation: bool = False) -> dict[str, dict[str, object]]:
    """Prepared objects bound to names, by kind: models, optimizers, schedulers, dataloaders;
    only those prepared on the current process group, or with ``any_generation`` on the newest
    one any of them was prepared on (the group may have been rebuilt since the failure that
    made recovery necessary; objects of older groups are leftovers no setup cell makes now)."""
    import torch

    from workbench.rank_state import STATE

    prepared = {name: obj for name, obj in namespace.items()
                if not name.startswith("_") and (getattr(obj, "_is_accelerate_prepared", False)
                                                 or getattr(obj, "_workbench_instrumented", False))}
    generation = STATE.spec.generation if STATE.spec else None
    if any_generation:
        generation = max((g for obj in prepared.values() if (g := getattr(obj, "_workbench_generation", None))
                          is not None), default=generation)
    found = {"model": {}, "optimizer": {}, "scheduler": {}, "dataloader": {}}
    for name, obj in prepared.items():
        if getattr(obj, "_workbench_generation", generation) != generation:
            continue  # prepared on a process group that has been rebuilt since: stale
        if isinstance(obj, torch.nn.Module):
            found["model"][name] = obj
        elif isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
            found["optimizer"][name] = obj
        elif hasattr(obj, "scheduler") and hasattr(obj, "state_dict"):
            found["scheduler"][name] = obj
        elif hasattr(obj, "__iter__") and hasattr(obj, "dataset"):
            found["dataloader"][name] = obj
    return found


def _owner(optimizer, models: dict) -> str | None:
    params = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    for name, model in models.items():
        if any(id(p) in params for p in model.parameters()):
            return name
    return None


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return state


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _optimizer_key(name: str, model) -> str:
    """``optimizer/<name>``; per stage for a pipeline stage (``@stage<i>``): DCP keeps one copy
    of the param groups (flattened by index) for all ranks, but every stage has its own."""
    stage = getattr(model, "stage_index", None)
    return f"optimizer/{name}" if stage is None else f"optimizer/{name}@stage{stage}"


PER_RANK_MARK = "@rank"


def per_rank_key(key: str, rank: int) -> str:
    """``data/loader`` -> ``data/loader@rank3``: an entry every rank saves with its own value
    (DCP would keep one rank's value for a name that every rank writes)."""
    return f"{key}{PER_RANK_MARK}{rank}"


def is_per_rank(key: str) -> bool:
    """Whether a checkpoint entry holds one rank's own value (RNG, a stream's position, ...)."""
    return key.startswith("rng/") or PER_RANK_MARK in key


def _name(key: str) -> str:
    """``data/loader@rank3`` -> ``loader``."""
    return key.split("/", 1)[1].split(PER_RANK_MARK)[0]


def _rank0(key: str) -> str:
    return key.rsplit(PER_RANK_MARK, 1)[0] + f"{PER_RANK_MARK}0"


def _user_value(obj):
    """What a checkpoint keeps of a registered object: a copy of the container, so that loading
    into it never clears the object it restores."""
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    return dict(obj) if isinstance(obj, dict) else list(obj)


class CheckpointState:
    """This rank's checkpoint content, built from its namespace."""

    def __init__(self, namespace: dict, rank: int, step: int, any_generation: bool = False) -> None:
        self.objects = prepared_objects(namespace, any_generation)
        self.rank = rank
        self.step = step
        self.pairs: dict[str, str] = {}  # optimizer name -> model name
        for name, optimizer in self.objects["optimizer"].items():
            owner = _owner(optimizer, self.objects["model"])
            if owner is None:
                raise CheckpointError(
                    f"optimizer {name!r} optimizes no prepared model in this namespace; "
                    "prepare its model with accelerator.prepare too"
                )
            self.pairs[name] = owner

    def positions(self) -> dict[str, tuple[str, object]]:
        """Each prepared loader's checkpoint key and position (a stream's key is this rank's own)."""
        found = {}
        for name, loader in self.objects["dataloader"].items():
            position = getattr(loader, "_workbench_position", None)
            if position is not None:
                key = f"data/{name}"
                found[name] = (per_rank_key(key, self.rank) if position.kind == "stream" else key, position)
        return found

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from workbench.metrics.logger import LOGGER

        state: dict = {"workbench": {"step": self.step}, f"rng/{self.rank}": rng_state()}
        with LOGGER.not_counting():  # DCP runs a dummy optimizer step to create empty optimizer state
            for name, model in self.objects["model"].items():
                state[f"model/{name}"] = get_model_state_dict(model)
            for name, optimizer in self.objects["optimizer"].items():
                model = self.objects["model"][self.pairs[name]]
                state[_optimizer_key(name, model)] = get_optimizer_state_dict(model, optimizer.optimizer)
        for name, scheduler in self.objects["scheduler"].items():
            state[f"scheduler/{name}"] = scheduler.state_dict()
        for key, position in self.positions().values():
            state[key] = position.state()
        for name, (obj, per_rank) in REGISTERED.items():
            state[per_rank_key(f"user/{name}", self.rank) if per_rank else f"user/{name}"] = _user_value(obj)
        return state

    def template(self, saved_keys: set[str], same_world: bool = True) -> dict:
        """What to load: this rank's state, limited to the top-level entries the checkpoint has.
        At another world size a stream's position is rank 0's (they agree where it can move)."""
        template = {}
        for key, value in self.state_dict().items():
            if not same_world and key.startswith("data/") and PER_RANK_MARK in key:
                key = _rank0(key)
            if key in saved_keys:
                template[key] = value
        return template

    def position_template(self, saved_keys: set[str]) -> dict:
        """The data positions to check before anything is loaded: global ones, and rank 0's of streams."""
        keys = {key if PER_RANK_MARK not in key else _rank0(key) for key, _ in self.positions().values()}
        return {key: "" for key in keys if key in saved_keys}

    def refusals(self, loaded_positions: dict, saved_keys: set[str], saved_world: int, world: int) -> list[str]:
        """Why this checkpoint cannot go on at ``world`` ranks (every rank finds the same)."""
        from workbench.data_position import refusal

        found = [refusal(_name(key), text, world)
                 for key, text in sorted(loaded_positions.items())]
        if saved_world != world:
            kept = sorted({_name(k) for k in saved_keys
                           if k.startswith("user/") and PER_RANK_MARK in k})
            found += [f"registered object {name!r} is per rank (saved by {saved_world} ranks): it cannot be "
                      f"restored into {world} ranks" for name in kept]
        return [f for f in found if f]

    def live_refusals(self, world: int) -> list[str]:
        """Why this rank's state cannot go on at ``world`` ranks (before a scale or a shrinking
        recover changes anything)."""
        positions = {key: position.state() for key, position in self.positions().values()}
        per_rank = {f"user/{name}{PER_RANK_MARK}{self.rank}" for name, (_, mine) in REGISTERED.items() if mine}
        from workbench.rank_state import STATE

        return self.refusals(positions, per_rank, STATE.world_size, world)

    def apply(self, loaded: dict) -> list[str]:
        """Put loaded values back into the live objects; return what was restored."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from workbench.metrics.logger import LOGGER

        restored = []
        for name, model in self.objects["model"].items():
            if f"model/{name}" in loaded:
                set_model_state_dict(model, loaded[f"model/{name}"])
                restored.append(name)
        with LOGGER.not_counting():
            for name, optimizer in self.objects["optimizer"].items():
                model = self.objects["model"][self.pairs[name]]
                if _optimizer_key(name, model) in loaded:
                    set_optimizer_state_dict(model, optimizer.optimizer, loaded[_optimizer_key(name, model)])
                    restored.append(name)
        for name, scheduler in self.objects["scheduler"].items():
            if f"scheduler/{name}" in loaded:
                scheduler.load_state_dict(loaded[f"scheduler/{name}"])
                restored.append(name)
        for name, (key, position) in self.positions().items():
            text = loaded.get(key, loaded.get(_rank0(key)) if PER_RANK_MARK in key else None)
            if text is not None:
                position.load(text)
                restored.append(name)
        for name, (obj, per_rank) in REGISTERED.items():
            value = loaded.get(per_rank_key(f"user/{name}", self.rank) if per_rank else f"user/{name}")
            if value is None:
                continue
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(value)
            else:
                obj[:] = value
            restored.append(name)
        if f"rng/{self.rank}" in loaded:
            set_rng_state(loaded[f"rng/{self.rank}"])
            restored.append("rng")
        return restored
