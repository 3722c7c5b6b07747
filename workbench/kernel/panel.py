"""Kernel side of the JupyterLab panel (extensions/panel): one comm per open panel.

The panel opens a comm with target ``workbench.kernel.panel`` in its notebook's kernel
(``%load_ext workbench`` registers it). The kernel then sends, from a thread so
that the panel stays live while a cell trains:

- ``{"type": "state", ...}``: the fleet (run, engines, spares, checkpoints),
  whenever it changes (checked every ``POLL_S``);
- ``{"type": "metrics", "run": id, "points": [...]}``: the metric records that
  arrived since the last message (the whole run's, up to ``HISTORY``, at open).

The comm only carries state to the panel. The panel's buttons run the magics a
user would type (``%fleet start -n N``, ``%fleet scale N``, ``%fleet stop``,
``%checkpoint save``, ``%checkpoint restore TAG``) as execute requests on the
kernel's main shell, so they wait for a running cell like typed input does.
JupyterLab (4.4+) sends comm messages over a kernel subshell, in another thread:
running fleet commands there, next to a cell that uses the same ipyparallel
client, would not be safe.

A snapshot reads only what other threads may read while a cell runs: the fleet's
member list, the heartbeats in the metrics store, the processes (psutil) and the
checkpoint folder. It never uses the ipyparallel client, which is not thread-safe.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

import psutil

from workbench.kernel.metrics.store import json_safe
from workbench.messages import EngineRow, PanelState

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

TARGET = "workbench.panel"  # the comm target the lab extension opens
POLL_S = 0.25
HISTORY = 5000  # metric records sent when a panel opens
SILENT_AFTER_S = 10.0  # a remote rank without a heartbeat this long shows as "silent"
LONG_CELL_S = 60.0  # the panel (and a browser notification) says when a cell that ran this long ended

_comms: dict[str, "PanelConnection"] = {}  # panel client id -> its open comm
_session = None  # the magics' FleetSession (current_fleet, current_metrics), given by register()
_comms_lock = threading.Lock()  # comms open on subshell threads


def _fleet_and_metrics() -> tuple:
    """The running fleet (or None) and the current or last run's metrics (or None)."""
    if _session is None:
        return None, None
    return _session.current_fleet(), _session.current_metrics()


def snapshot() -> PanelState:
    """The fleet as the panel shows it (see the module docstring for what it may read)."""
    from workbench.checkpoint import layout

    fleet, metrics = _fleet_and_metrics()
    state = PanelState(type="state", running=fleet is not None, run=metrics.run_id if metrics else None,
                       engines=[], spares={"ready": 0, "starting": 0}, checkpoints=[])
    if fleet is not None:
        streams = fleet.metrics.store.streams if fleet.metrics else {}
        slow = fleet.stragglers()
        state.update(world_size=fleet.world_size, backend=fleet.backend, run_dir=fleet.run_dir,
                     engines=[_engine_row(m, streams.get(m.rank), slow.get(m.rank)) for m in list(fleet.members)],
                     spares={"ready": len(fleet.pool.spares), "starting": len(fleet.pool.pending_spares)},
                     needs_recover=bool(fleet.session.fresh_ranks),
                     parked={"world": fleet.parked.world, "tag": fleet.parked.tag, "since": fleet.parked.since}
                     if fleet.parked is not None else None,
                     last_cell=_last_cell(fleet))
    if metrics is not None:
        folder = fleet.checkpoint_dir if fleet is not None else layout.checkpoints_dir(metrics.run_dir)
        for entry in _checkpoints(folder):
            row = {"tag": entry.tag, "state": entry.state}
            if entry.manifest is not None:
                row.update(step=entry.manifest.step, world_size=entry.manifest.world_size,
                           strategy=entry.manifest.strategy, created=entry.manifest.created)
            state["checkpoints"].append(row)
    return state


def _last_cell(fleet: Fleet) -> dict | None:
    """The newest cell that ended, from the run's record (its list is replaced, never changed in place)."""
    cells = fleet.record.cells if fleet.record is not None else []
    if not cells:
        return None
    cell = cells[-1]
    seconds = cell["ended"] - cell["started"]
    return {"cell": cell["cell"], "status": cell["status"], "seconds": seconds, "ended": cell["ended"],
            "long": seconds >= LONG_CELL_S}


REMOTE_LISTING_EVERY_S = 10.0  # the panel lists an object store's checkpoints this often at most
_remote_listing: dict[str, tuple[float, list]] = {}


def _checkpoints(folder: str) -> list:
    """The checkpoints in ``folder``; an object store's listing (several requests) is reused for a while."""
    from workbench.checkpoint import layout, storage

    if not storage.is_url(folder):
        return layout.list_checkpoints(folder, clean=False)
    listed_at, entries = _remote_listing.get(folder, (0.0, []))
    if time.monotonic() - listed_at > REMOTE_LISTING_EVERY_S:
        try:
            entries = layout.list_checkpoints(folder, clean=False)
        except Exception:  # noqa: BLE001 - unreachable storage: the panel shows none rather than failing
            entries = []
        _remote_listing[folder] = (time.monotonic(), entries)
    return entries


def _engine_row(member, stream, slow: float | None = None) -> EngineRow:
    state = "starting" if stream is None or stream.pid != member.pid else ("busy" if stream.busy else "idle")
    if member.local:
        try:
            if psutil.Process(member.pid).status() == psutil.STATUS_ZOMBIE:
                state = "dead"
        except psutil.Error:
            state = "dead"
    elif stream is not None and time.time() - stream.beat_at > SILENT_AFTER_S:
        state = "silent"
    if slow is not None and state in ("idle", "busy"):
        state = f"slow {slow:.1f}×"  # a straggler (workbench.kernel.metrics.stragglers)
    memory = (stream.memory if stream is not None else {}) or {}
    memory_mb = memory.get("cuda_max_mb", memory.get("rss_mb"))
    return EngineRow(rank=member.rank, engine=member.engine_id, pid=member.pid, host=member.host,
                     device=member.device, state=state,
                     # whole MiB, as shown: fractions would resend the state with every heartbeat
                     memory_mb=None if memory_mb is None else round(memory_mb))


def _points(records) -> list[list]:
    """``[rank, step, time, scalars, samples_per_s, step_time_s]`` per record: what the curves need."""
    return [[r.rank, r.step, r.time, r.scalars, r.system.get("samples_per_s"), r.system.get("step_time_s")]
            for r in records]


class PanelConnection:
    """One open panel: sends it state and metrics from a thread."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.closed = threading.Event()
        self.sent_state = None
        self.last_error = None
        self.run, self.sent_records = None, 0
        comm.on_close(lambda _msg: self.closed.set())
        self.thread = threading.Thread(target=self._publish, name="workbench-panel", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed.set()
        try:
            self.comm.close()
        except Exception:
            pass

    def _publish(self) -> None:
        while not self.closed.is_set():
            try:
                self.publish_once()
            except Exception as exc:  # a snapshot taken while the fleet changes: try again next poll
                self.last_error = repr(exc)
            self.closed.wait(POLL_S)

    def publish_once(self) -> None:
        text = json.dumps(snapshot(), sort_keys=True, default=str)
        if text != self.sent_state:
            self.comm.send(json.loads(text))
            self.sent_state = text
        metrics = _fleet_and_metrics()[1]
        if metrics is None:
            return
        store = metrics.store
        if metrics.run_id != self.run:
            self.run, self.sent_records = metrics.run_id, max(0, len(store) - HISTORY)
        new = store.since(self.sent_records)
        if new:
            self.comm.send({"type": "metrics", "run": self.run, "points": json_safe(_points(new))})
            self.sent_records += len(new)


def register(ipython, session) -> bool:
    """Register the panel's comm target in this kernel, showing ``session``'s fleet
    (:class:`workbench.kernel.magics.FleetSession`); False outside a kernel."""
    global _session
    _session = session
    try:
        from comm import get_comm_manager
    except ImportError:
        return False
    kernel = getattr(ipython, "kernel", None)
    if kernel is None:
        return False

    def opened(comm, msg) -> None:
        client = str((msg["content"].get("data") or {}).get("client", comm.comm_id))
        with _comms_lock:
            previous = _comms.pop(client, None)
            if previous is not None:  # the same browser tab, reloaded: its old comm has no listener
                previous.close()
            _comms[client] = PanelConnection(comm)

    get_comm_manager().register_target(TARGET, opened)
    return True


def close_all() -> None:
    with _comms_lock:
        for connection in _comms.values():
            connection.close()
        _comms.clear()


def unregister(ipython) -> None:
    """Close the panel's connections and remove its comm target (``%unload_ext workbench``)."""
    if getattr(ipython, "kernel", None) is None:
        return
    from comm import get_comm_manager

    with _comms_lock:
        connections = list(_comms.values())
        _comms.clear()
    for connection in connections:
        connection.close()
    get_comm_manager().unregister_target(TARGET, None)
