"""What a fleet needs to know of each of ipyparallel's engine launchers, in one table.

ipyparallel finds its launchers by name through its ``ipyparallel.engine_launchers``
entry points (local, mpi, slurm, pbs, sge, lsf, htcondor, ssh, ...), and any of them
starts a fleet's engines (``--launcher NAME``). :data:`KINDS` says what differs for a
fleet; a launcher it does not name is taken as a batch system (:data:`BATCH`): its
engines may run on other hosts, each rank its own job, ``--partition`` its queue.
Pure data: the options (engine side too) read it; :mod:`workbench.kernel.launchers` acts on it.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, field

LOCAL = "local"


@dataclass(frozen=True)
class LauncherKind:
    remote: bool = True
    """its engines may run on other hosts (the controller and metrics then listen on the network)"""
    placed_by_hosts: bool = False
    """--hosts / --hostfile name where its engines start"""
    node_jobs: bool = False
    """a node's ranks start together as one job (one task a rank)"""
    stops_engines: bool = False
    """its engines are stopped through the launcher, not asked to exit first"""
    probe: str | None = None
    """how a host whose ranks went silent is asked whether it is there: 'ssh' (port 22) or 'slurmd'"""
    shortcuts: dict[str, str] = field(default_factory=dict)
    """workbench's option names (--partition, --time, ...) -> the launcher's own trait"""


BATCH_SHORTCUTS = {"partition": "queue", "queue": "queue"}
BATCH = LauncherKind(shortcuts=BATCH_SHORTCUTS)
KINDS: dict[str, LauncherKind] = {
    LOCAL: LauncherKind(remote=False),
    "mpi": LauncherKind(remote=False, shortcuts={"mpi_args": "mpi_args"}),
    "slurm": LauncherKind(placed_by_hosts=True, node_jobs=True, probe="slurmd",
                          shortcuts={**BATCH_SHORTCUTS, "time": "timelimit", "account": "account", "qos": "qos"}),
    "pbs": BATCH,
    "ssh": LauncherKind(placed_by_hosts=True, stops_engines=True, probe="ssh"),
}


def kind_of(name: str) -> LauncherKind:
    return KINDS.get(name, BATCH)


@functools.cache
def launcher_names() -> tuple[str, ...]:
    """Every engine launcher ipyparallel has here (its entry points; the local one first)."""
    found = {ep.name for ep in importlib.metadata.entry_points(group="ipyparallel.engine_launchers")}
    return (LOCAL, *sorted((found | set(KINDS)) - {LOCAL}))
