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

from ..errors import CheckpointError

REGISTERED: dict[str, object] = {}


def prepared_objects(namespace: dict, any_generation: bool = False) -> dict[str, dict[str, object]]:
    """Prepared objects bound to names, by kind: models, optimizers, schedulers, dataloaders;
    only those prepared on the current process group, unless ``any_generation``."""
    import torch

    from ..rank import STATE

    generation = STATE.spec.generation if STATE.spec else None
    found = {"model": {}, "optimizer": {}, "scheduler": {}, "dataloader": {}}
    for name, obj in namespace.items():
        if name.startswith("_") or not (getattr(obj, "_is_accelerate_prepared", False)
                                        or getattr(obj, "_workbench_instrumented", False)):
            continue
        if not any_generation and getattr(obj, "_workbench_generation", generation) != generation:
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

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict = {"workbench": {"step": self.step}, f"rng/{self.rank}": rng_state()}
        for name, model in self.objects["model"].items():
            state[f"model/{name}"] = get_model_state_dict(model)
        for name, optimizer in self.objects["optimizer"].items():
            model = self.objects["model"][self.pairs[name]]
            state[_optimizer_key(name, model)] = get_optimizer_state_dict(model, optimizer.optimizer)
        for name, scheduler in self.objects["scheduler"].items():
            state[f"scheduler/{name}"] = scheduler.state_dict()
        for name, loader in self.objects["dataloader"].items():
            state[f"dataloader/{name}"] = {"epoch": int(getattr(loader, "iteration", 0)),
                                           "batches": int(getattr(loader, "_workbench_batches", 0))}
        for name, obj in REGISTERED.items():
            state[f"user/{name}"] = obj.state_dict() if hasattr(obj, "state_dict") else obj
        return state

    def template(self, saved_keys: set[str]) -> dict:
        """What to load: this rank's state, limited to the top-level entries the checkpoint has."""
        state = self.state_dict()
        return {key: value for key, value in state.items() if key in saved_keys}

    def apply(self, loaded: dict) -> list[str]:
        """Put loaded values back into the live objects; return what was restored."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        restored = []
        for name, model in self.objects["model"].items():
            if f"model/{name}" in loaded:
                set_model_state_dict(model, loaded[f"model/{name}"])
                restored.append(name)
        for name, optimizer in self.objects["optimizer"].items():
            model = self.objects["model"][self.pairs[name]]
            if _optimizer_key(name, model) in loaded:
                set_optimizer_state_dict(model, optimizer.optimizer, loaded[_optimizer_key(name, model)])
                restored.append(name)
        for name, scheduler in self.objects["scheduler"].items():
            if f"scheduler/{name}" in loaded:
                scheduler.load_state_dict(loaded[f"scheduler/{name}"])
                restored.append(name)
        for name, loader in self.objects["dataloader"].items():
            position = loaded.get(f"dataloader/{name}")
            if position is not None:
                loader.iteration = position["epoch"]
                loader.skip_batches = position["batches"]  # for the next pass only
                restored.append(name)
        for name, obj in REGISTERED.items():
            value = loaded.get(f"user/{name}")
            if value is not None:
                if hasattr(obj, "load_state_dict"):
                    obj.load_state_dict(value)
                elif isinstance(obj, dict):
                    obj.clear()
                    obj.update(value)
                restored.append(name)
        if f"rng/{self.rank}" in loaded:
            set_rng_state(loaded[f"rng/{self.rank}"])
            restored.append("rng")
        return restored
