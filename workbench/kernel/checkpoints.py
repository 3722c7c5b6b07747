"""Kernel side: save, list, restore and remove a fleet run's checkpoints.

``fleet.checkpoints`` is a :class:`Checkpoints`; ``%checkpoint`` parses its
arguments and calls it. Saving and restoring run on every rank; listing and
removing only read the run's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from workbench.checkpoint import api, hf_export, layout, replica, storage
from workbench.checkpoint.failures import OS_REASONS
from workbench.errors import CheckpointError
from workbench.kernel import execution
from workbench.rank import engine

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

EXPORT_TIMEOUT_S = 3600.0


class Checkpoints:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    @property
    def folder(self) -> str:
        """Where the fleet's checkpoints go (a folder or an fsspec URL)."""
        if self.fleet.checkpoint_dir is None:
            raise CheckpointError("no fleet is running; start one with %fleet start -n 2")
        return self.fleet.checkpoint_dir

    def _on_every_rank(self, fn, *args, **kwargs) -> list:
        ranks = self.fleet.targets(None)
        try:
            result = execution.run_on_ranks(self.fleet, ranks, engine.call, (fn, args, kwargs), show_output=False)
        except execution.DistributedCellError as exc:
            primary = [f for f in exc.failures if not f.stopped]
            if primary and all(f.ename == "CheckpointError" for f in primary):
                raise CheckpointError(_one_reason([f.evalue for f in primary])) from None
            raise
        return result.values()

    def save(self, tag: str | None = None, *, async_: bool = False, keep_last: int | None = None,
             to: str | None = None) -> str:
        """Save a checkpoint on every rank; returns its tag (at once for ``async_``). ``to``: a
        folder or fsspec URL to save into instead of the fleet's checkpoint folder."""
        if tag is not None:
            layout.check_tag(tag)
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"--keep-last must be at least 1 (got {keep_last})")
        if to is not None:
            to = storage.absolute(to)
            storage.store_for(to).prepare(to)  # a missing bucket or a bad URL: one line, before the ranks
        return self._on_every_rank(api.save, tag, async_=async_, keep_last=keep_last, to=to)[0]

    def list(self, folder: str | None = None) -> list[layout.Entry]:
        """The checkpoints in the fleet's folder (or in ``folder``: a folder or an fsspec URL)."""
        return layout.list_checkpoints(storage.absolute(folder) if folder else self.folder)

    def restore(self, tag: str = "latest") -> dict:
        """Restore ``tag`` ('latest', a tag or a folder) on every rank; returns rank 0's report."""
        layout.resolve(self.folder, tag)  # a clear error before any rank is involved
        return self._on_every_rank(api.restore, tag)[0]

    def from_replica(self, sources: list) -> dict:
        """Every rank takes the state set aside before recover replayed the setup cells, from the
        survivor that holds what it holds (``[holds, rank]`` pairs, :mod:`workbench.checkpoint.replica`); returns
        rank 0's report."""
        return self._on_every_rank(replica.share, sources)[0]

    def export(self, tag: str, out: str, model: str | None = None) -> list[str]:
        """Write checkpoint ``tag``'s model ``model`` (default: the fleet's only prepared model,
        else ``model``) as a Hugging Face folder ``out`` (``config.json`` from rank 0's model
        while the fleet runs, safetensors shards); returns the files written."""
        path = layout.resolve(self.folder, tag)
        out = os.path.abspath(os.path.expanduser(out))
        if os.path.isdir(out) and os.listdir(out):
            raise CheckpointError(f"{out} is not empty; export into a new folder")
        description = None
        if self.fleet.running:
            if model is None:
                names = self._on_rank0(hf_export.prepared_models)
                if len(names) > 1:
                    raise CheckpointError(f"the fleet has {len(names)} prepared models ({', '.join(names)}); "
                                          "name one with --model NAME")
                model = names[0] if names else None
            if model is not None:
                description = self._on_rank0(hf_export.describe_model, model)
        return _run_export(path, out, model or "model", description)

    def _on_rank0(self, fn, *args):
        return execution.run_on_ranks(self.fleet, [0], engine.call, (fn, args, {}), show_output=False).values()[0]

    def wait(self) -> None:
        """Wait for background saves on every rank to finish (errors are raised)."""
        self._on_every_rank(api.wait)

    def remove(self, tag: str) -> None:
        entries = {e.tag: e for e in self.list()}
        entry = entries.get(tag)
        if entry is None:
            known = ", ".join(t for t, e in entries.items() if e.state == "complete") or "none"
            raise CheckpointError(f"no checkpoint named {tag!r}; complete checkpoints: {known}")
        if entry.state == "writing":
            raise CheckpointError(f"checkpoint {tag!r} is still being written; wait for it, then rm it")
        storage.store_for(entry.path).rmtree(entry.path)

    def table(self, folder: str | None = None) -> str:
        """``%checkpoint list``: the checkpoints of the fleet's folder (or of ``folder``) as a table."""
        entries = self.list(folder)
        if not entries:
            return f"no checkpoints yet in {folder or self.folder}; save one with %checkpoint save"
        rows = [["tag", "step", "world size", "strategy", "size", "time", "state"]]
        for entry in entries:
            m = entry.manifest
            if m is None:
                rows.append([entry.tag, "", "", "", "", "", "writing…"])
                continue
            when = time.strftime("%H:%M:%S", time.localtime(m.created))
            rows.append([m.tag, str(m.step), str(m.world_size), m.strategy, _size(m.size), when, "complete"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _one_reason(reasons: list[str]) -> str:
    """One line for a save or load that failed on several ranks, each in its own words (a full
    disk is ENOSPC on one rank and a broken peer on another): the OS reason if a rank has one."""
    return next((r for r in reasons if any(os_reason in r for os_reason in OS_REASONS)), reasons[0])


def _run_export(checkpoint: str, out: str, name: str, description: dict | None) -> list[str]:
    """:mod:`workbench.checkpoint.hf_export` in a process of its own: the full model never sits in the kernel or on a rank."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(description, f)
    args = [sys.executable, "-m", "workbench.checkpoint.hf_export", checkpoint, out, name]
    try:
        done = subprocess.run(args + ([f.name] if description is not None else []), capture_output=True,
                              text=True, timeout=EXPORT_TIMEOUT_S)
    finally:
        os.remove(f.name)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        if "KeyError" in reason and f"model/{name}" in reason:
            reason = f"checkpoint has no model named {name!r}; name it with --model NAME"
        raise CheckpointError(f"export of {os.path.basename(checkpoint)} failed: {reason}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
