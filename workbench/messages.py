"""The messages that cross the rank/kernel boundary, each defined once.

They travel as plain dicts (ipyparallel results, JSON over zmq, a Jupyter comm), so they
are ``TypedDict``s: a type checker sees what producer and consumer agree on, and nothing
costs more at run time than the dict itself. Bottom layer: both sides import it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, NotRequired, TypedDict

REDRAW_MARK = "\u2060"
"""Written after each carriage return on a rank (an invisible word joiner): the line is a progress
bar redrawn in place. ipyparallel keeps only what follows a line's last ``\\r``, so without it the
kernel could not tell a bar's final state from a printed line."""


def sign(key: bytes, payload: bytes) -> bytes:
    """A metrics message's signature: HMAC-SHA256 with the run's key (the collector drops the rest)."""
    return hmac.new(key, payload, hashlib.sha256).digest()


class MetricsMark(TypedDict):
    """How far a rank's metrics got when its cell ended: the kernel waits for record ``seq``."""

    pid: int
    seq: int
    cell: int


class CellReply(TypedDict):
    """A rank's answer to a cell, a function call or a pull (:mod:`workbench.rank.engine`)."""

    ok: bool
    value: NotRequired[Any]  # the last expression's value (tensors on CPU), when asked for
    display: NotRequired[dict | None]  # its mimebundle, for rank 0's cell result
    ename: NotRequired[str]  # on failure: exception name, message and the user's traceback
    evalue: NotRequired[str]
    traceback: NotRequired[str]
    group_intact: NotRequired[bool]  # the rank's process group can still be used
    metrics: NotRequired[MetricsMark]
    notices: NotRequired[list[str]]  # background problems to show once (a failed async save, ...)
    config: NotRequired[dict]  # workbench.config(...) values recorded on the rank since its last reply


class Identity(TypedDict):
    """Who an engine is (:func:`workbench.rank.rendezvous.identify`)."""

    slot: int  # the launch slot the fleet gave it (WORKBENCH_SLOT)
    pid: int
    host: str
    gpu: str | None


class Joined(TypedDict):
    """A rank that joined the process group (:func:`workbench.rank.rendezvous.join`)."""

    rank: int
    device: str
    backend: str


class Beat(TypedDict):
    """A rank's heartbeat: what its main thread is doing (:class:`workbench.kernel.watchdog.HangWatch`)."""

    stalled_s: float | None  # seconds without progress (steps, collectives launched) in user code
    stack: str | None  # the main thread's stack once it stalls
    busy: bool  # running user code
    waiting_in: str | None  # the collective it waits in: torch.distributed.all_reduce, or a DDP backward
    waiting_s: float | None
    cell: NotRequired[int]  # the cell the rank is in


class MetricsMessage(TypedDict):
    """One batch from a rank's metrics sender to the kernel's collector (JSON over zmq)."""

    pid: int
    rank: int | None
    dropped: int  # records dropped because the kernel was behind
    total: int
    memory: dict[str, float]
    beat: Beat
    records: list[list]  # [time, seq, step, scalars, system]


class KeptState(TypedDict):
    """What a survivor set aside for recovery (:func:`workbench.checkpoint.replica.keep`)."""

    step: int
    replicated: bool  # it can be sent to a new rank (the whole state, or one shard that replicas share)
    keys: list[str]
    holds: list | None  # which shard of each sharded model (None: the whole state); equal on replicas
    shards: int  # how many different shards there are (1: the whole state)


class Restored(TypedDict):
    """What a restore loaded on a rank (from a checkpoint, or a live replica without ``tag``)."""

    step: int
    restored: list[str]
    tag: NotRequired[str]
    saved_world_size: NotRequired[int]
    world_size: NotRequired[int]
    path: NotRequired[str]


class EngineRow(TypedDict):
    """One rank as the lab panel shows it."""

    rank: int
    engine: int
    pid: int
    host: str
    device: str
    state: str  # starting | idle | busy | dead | silent | slow 1.6× (a straggler)
    memory_mb: int | None


class PanelState(TypedDict):
    """The fleet as the lab panel shows it (``{"type": "state"}`` on the panel's comm)."""

    type: str
    running: bool
    run: str | None
    engines: list[EngineRow]
    spares: dict[str, int]  # ready, starting
    checkpoints: list[dict]
    world_size: NotRequired[int]
    backend: NotRequired[str]
    run_dir: NotRequired[str]
    needs_recover: NotRequired[bool]
    parked: NotRequired[dict | None]  # %fleet park: {"world": ranks it had, "tag": its checkpoint, "since": time}
    last_cell: NotRequired[dict | None]  # the newest cell that ended: cell, status, seconds, ended, long
