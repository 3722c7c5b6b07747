"""Kernel side: ``%fleet export train.py``, a notebook's training as a batch job.

The script holds the fleet's recorded ``--setup`` cells and its last training
cell (the last ``%%distributed`` cell that ran on every rank), in order, each
after the line that gives it the names of a ``%%distributed`` cell with its own
flags (:mod:`workbench.script`). It runs unchanged under ``torchrun
--nproc-per-node N``, ``accelerate launch --multi_gpu --num_processes N`` and ``python``
(one process). A fleet started with ``--launcher slurm`` also gets an sbatch
file with its Slurm options that runs the script with torchrun on every node.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import time

from workbench.errors import FleetError
from workbench.options import CellOptions

RDZV_PORT = 29500


def export(path: str, setup_cells: list[tuple[str, CellOptions]], training_cell: tuple[str, CellOptions] | None,
           *, world_size: int, nodes: int, run_id: str | None, gpus: bool = False,
           slurm_options: dict | None = None, overwrite: bool = False) -> tuple[list[str], list[str]]:
    """Write the script (and ``<stem>.sbatch`` with ``slurm_options``); return the paths written
    and a warning per cell that uses IPython syntax (magics, ``!`` commands)."""
    if training_cell is None and not setup_cells:
        raise FleetError("nothing to export yet: run the --setup cells and a training cell with %%distributed first")
    if not path.endswith(".py"):
        raise FleetError(f"export writes a Python script: give a name ending in .py (got {path!r})")
    sbatch = os.path.splitext(path)[0] + ".sbatch" if slurm_options is not None else None
    for target in (path, sbatch):
        if target and os.path.exists(target) and not overwrite:
            raise FleetError(f"{target} exists; pass --force to overwrite it")
    cells = [("setup cell", code, options) for code, options in setup_cells]
    if training_cell is not None:
        cells.append(("training cell", *training_cell))
    text, warnings = script_text(cells, world_size, run_id, os.path.basename(path))
    _write(path, text, 0o755)
    written = [path]
    if sbatch:
        _write(sbatch, sbatch_text(os.path.basename(path), world_size, nodes, slurm_options, gpus), 0o644)
        written.append(sbatch)
    return written, warnings


def script_text(cells: list[tuple[str, str, CellOptions]], world_size: int, run_id: str | None,
                name: str = "train.py") -> tuple[str, list[str]]:
    """The script's text, and a warning per cell that needs IPython to run."""
    head = f'''#!/usr/bin/env python
"""Exported by workbench on {time.strftime("%Y-%m-%d %H:%M")} from fleet run {run_id or "?"}: its --setup
cells and its last training cell, each with the names of a %%distributed cell.

Run it with any of:
    torchrun --nproc-per-node {world_size} {name}
    accelerate launch --multi_gpu --num_processes {world_size} {name}   # also on CPU
    python {name}        # one process
Metrics and checkpoints go to ./workbench-runs/<run-id>/, as in the notebook.
"""
import workbench.script

script = workbench.script.start()
'''
    parts, warnings = [head], []
    numbered = sum(1 for kind, _, _ in cells if kind == "setup cell") > 1
    for index, (kind, code, options) in enumerate(cells, 1):
        python, uses_ipython = _plain_python(code)
        title = f"{kind} {index}" if numbered and kind == "setup cell" else kind
        if uses_ipython:
            warnings.append(f"the {title} uses IPython syntax (a magic or ! command): the script calls "
                            "get_ipython() there, which a plain Python process does not have; edit that line")
        flags = _flags(options)
        parts.append(f"\n# ── {title}: %%distributed{' --setup' if kind == 'setup cell' else ''}"
                     f"{' ' + flags if flags else ''} ──\n")
        parts.append(f"globals().update(script.cell({_arguments(options)}))\n")
        parts.append(python.rstrip() + "\n")
    parts.append("\nscript.finish()\n")
    return "".join(parts), warnings


def sbatch_text(script: str, world_size: int, nodes: int, options: dict, gpus: bool = False) -> str:
    """An sbatch file for the fleet's Slurm options: one torchrun per node, rendezvous on the first."""
    per_node = max(1, world_size // max(1, nodes))
    lines = ["#!/bin/bash", f"#SBATCH --job-name={os.path.splitext(script)[0]}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1"]
    slurm_names = {"queue": "partition", "timelimit": "time"}
    for trait, value in sorted(options.items()):
        name = slurm_names.get(trait, trait).replace("_", "-")
        if name in ("partition", "time", "account", "qos"):
            lines.append(f"#SBATCH --{name}={value}")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    lines += [
        "set -euo pipefail",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per_node} --rdzv-backend c10d \\',
        f'    --rdzv-endpoint "$head:{RDZV_PORT}" --rdzv-id "$SLURM_JOB_ID" {shlex.quote(script)}',
    ]
    return "\n".join(lines) + "\n"


def _plain_python(code: str) -> tuple[str, bool]:
    """``code`` with IPython syntax turned into calls (as IPython runs it); whether there was any."""
    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager().transform_cell(code)
    return python, "get_ipython()" in python and "get_ipython()" not in code


def _changed(options: CellOptions) -> dict:
    default = CellOptions()
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if getattr(options, f.name) != getattr(default, f.name)}


def _arguments(options: CellOptions) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in _changed(options).items())


def _flags(options: CellOptions) -> str:
    flags = []
    for name, value in _changed(options).items():
        flag = "--" + name.replace("_", "-")
        flags.append(flag if value is True else f"{flag} {value}")
    return " ".join(flags)


def _write(path: str, text: str, mode: int) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FleetError(f"cannot write {path}: the folder {folder} does not exist")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
