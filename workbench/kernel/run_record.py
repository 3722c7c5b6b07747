"""Kernel side: ``<run>/run.json``, the record of a fleet run that outlives it.

Name, notebook, start and end, status (running / stopped / crashed), the fleet's options, each
cell (flags, ranks, start, end, status), the final value of every logged scalar, and the user's
config (``workbench.config(lr=3e-4)`` on a rank or in the kernel). Rewritten atomically at the
start and at stop, and after cells at most every WRITE_EVERY_S (rewriting it after every cell
cost an empty cell 5-10 ms); a run whose owner died while it was ``running`` reads as
``crashed``. The same config goes to wandb and TensorBoard's HParams (:meth:`Fleet.record_config`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field

RUN_FILE = "run.json"
MAX_CELLS = 1000  # the newest cells kept in the record (a long session runs many)
WRITE_EVERY_S = 2.0


def notebook_path() -> str | None:
    """The notebook this kernel runs, where the front end says (Jupyter server 2, VS Code)."""
    path = os.environ.get("JPY_SESSION_NAME")
    if path:
        return path
    try:
        from IPython import get_ipython

        shell = get_ipython()
        return shell.user_ns.get("__vsc_ipynb_file__") if shell is not None else None
    except ImportError:
        return None


@dataclass
class RunRecord:
    """What ``run.json`` holds (see the module docstring)."""

    id: str
    name: str
    notebook: str | None
    started: float
    owner_pid: int
    host: str
    options: dict
    status: str = "running"
    ended: float | None = None
    cells: list[dict] = field(default_factory=list)
    final: dict = field(default_factory=dict)  # scalar -> {"value", "step", "rank"}: its last value (lowest rank)
    config: dict = field(default_factory=dict)

    @classmethod
    def begin(cls, run_id: str, run_dir: str, name: str | None, options: dict) -> "RunRecord":
        notebook = notebook_path()
        default = os.path.splitext(os.path.basename(notebook))[0] if notebook else run_id
        record = cls(id=run_id, name=name or default, notebook=notebook, started=time.time(),
                     owner_pid=os.getpid(), host=socket.gethostname(), options=options)
        record.path = os.path.join(run_dir, RUN_FILE)
        record.flush()
        return record

    def cell(self, title: str, flags: dict, ranks: list[int], started: float, status: str, error: str = "",
             records: list | None = None) -> None:
        """Add a cell that ended (``status``: ok, failed, interrupted) and its scalars' last values."""
        entry = {"cell": title, "flags": flags, "ranks": ranks, "started": started, "ended": time.time(),
                 "status": status}
        if error:
            entry["error"] = error
        self.cells = [*self.cells, entry][-MAX_CELLS:]
        last: dict[str, dict[int, dict]] = {}  # scalar -> rank -> its last value in this cell
        for record in records or ():
            for name, value in record.scalars.items():
                last.setdefault(name, {})[record.rank] = {"value": value, "step": record.step, "rank": record.rank}
        self.final.update({name: by_rank[min(by_rank)] for name, by_rank in last.items()})  # the lowest rank's
        self.write()

    def add_config(self, values: dict) -> None:
        self.config.update(values)
        self.write()

    def end(self) -> None:
        self.status, self.ended = "stopped", time.time()
        self.flush()

    def write(self) -> None:
        """Write soon: now if the last write is WRITE_EVERY_S old, else at the next write or :meth:`flush`."""
        if time.monotonic() - getattr(self, "_written_at", 0.0) >= WRITE_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Write ``run.json`` now: atomically, owner-only; a full disk costs the record, never the run."""
        self._written_at = time.monotonic()
        tmp = f"{self.path}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(_finite(asdict(self)), f, indent=1, default=str)
            os.replace(tmp, self.path)
        except OSError:
            pass


def read(run_dir: str) -> dict | None:
    """A run's record, ``crashed`` if its owner died while it ran (on this host); None if it has none."""
    try:
        with open(os.path.join(run_dir, RUN_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if record.get("status") == "running" and record.get("host") == socket.gethostname() \
            and not _alive(record.get("owner_pid")):
        record["status"] = "crashed"
    return record


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _finite(value):
    """NaN and infinities as text: run.json stays standard JSON (a diverged loss is a final value too)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
