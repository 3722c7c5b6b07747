"""A checkpoint's model as a Hugging Face folder: ``config.json`` and safetensors shards.

``%checkpoint export TAG --hf DIR`` runs :func:`main` in a process of its own (the full
model is assembled on the CPU there, never on a rank's GPU, and its memory goes back when it
ends): the model's entries are read from the DCP checkpoint as full tensors (safely: no
unpickling), written with huggingface_hub's ``save_torch_state_dict`` (the shards and index
``save_pretrained`` writes), and the model's config, asked of rank 0 while the fleet runs
(:func:`describe_model`), becomes ``config.json``. A model without a Hugging Face config gets
``model.safetensors`` alone. Engine side (:func:`describe_model`) and a script (:func:`main`).
"""

from __future__ import annotations

import json
import os
import sys

MODEL_PREFIX = "model/"


def describe_model(name: str) -> dict | None:
    """On a rank: the Hugging Face config of the model ``name`` in its namespace, and its class
    as ``from_pretrained`` needs it (not the DDP/FSDP wrapper's); None for a plain module."""
    from workbench.rank_state import namespace

    model = namespace().get(name)
    model = getattr(model, "module", model)  # DDP keeps the model in .module; FSDP2 subclasses it
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    cls = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    return {"config": config.to_dict(), "architecture": cls.__name__}


def prepared_models() -> list[str]:
    """On a rank: the names of its prepared models (what a checkpoint saves under ``model/``)."""
    from workbench.checkpoint.state import CheckpointState
    from workbench.metrics.logger import LOGGER
    from workbench.rank_state import STATE, namespace

    return sorted(CheckpointState(namespace(), STATE.spec.rank, LOGGER.step).objects["model"])


def model_names(checkpoint: str) -> list[str]:
    """The prepared models a checkpoint holds (its ``model/<name>`` entries)."""
    from workbench.checkpoint.safe_io import safe_reader

    metadata = safe_reader(checkpoint).read_metadata()
    names = {key[len(MODEL_PREFIX):].split(".", 1)[0] for key in metadata.state_dict_metadata
             if key.startswith(MODEL_PREFIX)}
    return sorted(names)


def full_state_dict(checkpoint: str, name: str) -> dict:
    """The model ``name``'s entries of ``checkpoint`` as full CPU tensors (any world size, any
    sharding), read in this process without a process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from workbench.checkpoint.safe_io import safe_reader

    key = f"{MODEL_PREFIX}{name}"
    loaded = _load_state_dict_from_keys({key}, storage_reader=safe_reader(checkpoint))
    return loaded[key]


def write(checkpoint: str, out: str, name: str, description: dict | None) -> list[str]:
    """Write the Hugging Face folder ``out``; returns the files written."""
    from huggingface_hub import save_torch_state_dict

    state = full_state_dict(checkpoint, name)
    os.makedirs(out, exist_ok=True)
    save_torch_state_dict(state, out, max_shard_size="5GB")
    if description is not None:
        config = {**description["config"], "architectures": [description["architecture"]]}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return sorted(os.listdir(out))


def main(argv: list[str]) -> None:
    """``python -m workbench.checkpoint.hf_export CHECKPOINT OUT NAME [DESCRIPTION.json]``"""
    checkpoint, out, name = argv[:3]
    description = None
    if len(argv) > 3:
        with open(argv[3]) as f:
            description = json.load(f)
    print(json.dumps(write(checkpoint, out, name, description)))


if __name__ == "__main__":
    main(sys.argv[1:])
