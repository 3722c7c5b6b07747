"""Kernel side of the JupyterLab panel (extensions/panel): one comm per open panel.

The panel opens a comm with target ``workbench.panel`` in its notebook's kernel
(``%load_ext workbench`` registers it). The kernel then sends, from a thread so
that the panel stays live while a cell trains:

- ``{"type": "state", ...}``: the fleet (run, engines, spares, checkpoints),
  whenever it changes (checked every ``POLL_S``);
- ``{"type": "metrics", "run": id, "points": [...]}``: the metric records that
  arrived since the last message (the whole run's, up to ``HISTORY``, at open).

The panel's buttons send ``{"action": "start"|"scale"|"stop"|"save"|"restore", ...}``;
each runs the magic a user would type, on the kernel's main thread, and is
answered with ``{"type": "reply", "id", "ok", "output"}``.

A snapshot reads only what other threads may read while a cell runs: the fleet's
member list, the heartbeats in the metrics store, the processes (psutil) and the
checkpoint folder. It never uses the ipyparallel client, which is not thread-safe.
"""

from __future__ import annotations

import json
import shlex
import socket
import threading
import time

import psutil

TARGET = "workbench.panel"
POLL_S = 0.25
HISTORY = 5000  # metric records sent when a panel opens
SILENT_AFTER_S = 10.0  # a remote rank without a heartbeat this long shows as "silent"
ACTIONS = ("start", "scale", "stop", "save", "restore")

_comms: dict[str, object] = {}  # panel client id -> its open comm


def _magic_line(action: str, data: dict) -> tuple[str, str]:
    """The magic a button stands for, checked like typed input: ``(magic, line)``."""

    def count(name: str) -> int:
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{action} needs a whole number {name!r} (got {value!r})")
        return value

    if action == "start":
        spares = data.get("spares", 0)
        return "fleet", f"start -n {count('n')}" + (f" --spares {count('spares')}" if spares else "")
    if action == "scale":
        return "fleet", f"scale {count('n')}"
    if action == "stop":
        return "fleet", "stop"
    tag = data.get("tag")
    if tag is not None and not isinstance(tag, str):
        raise ValueError(f"a checkpoint tag is a string (got {tag!r})")
    tag = shlex.quote(tag) if tag else None  # the magic checks the tag itself
    if action == "save":
        return "checkpoint", "save" + (f" --tag {tag}" if tag else "")
    if action == "restore":
        return "checkpoint", f"restore {tag or 'latest'}"
    raise ValueError(f"unknown panel action {action!r}; one of: {', '.join(ACTIONS)}")


def run_action(ipython, data: dict) -> dict:
    """Run one panel action as its magic; return the reply (its output, or its error)."""
    from IPython.utils.capture import capture_output

    reply = {"type": "reply", "id": data.get("id"), "action": data.get("action")}
    try:
        magic, line = _magic_line(data.get("action"), data)
    except ValueError as exc:
        return {**reply, "ok": False, "output": str(exc)}
    reply["command"] = f"%{magic} {line}"
    with capture_output(display=False) as captured:
        try:
            ipython.run_line_magic(magic, line)
            ok, error = True, ""
        except BaseException as exc:  # KeyboardInterrupt included: the reply must still go out
            ok, error = False, f"{type(exc).__name__}: {exc}" if type(exc).__name__ != "UsageError" else str(exc)
    output = (captured.stdout + captured.stderr).replace("\r", "\n").strip()
    return {**reply, "ok": ok, "output": "\n".join(t for t in (output, error) if t)}


def snapshot() -> dict:
    """The fleet as the panel shows it (see the module docstring for what it may read)."""
    from .checkpoint import layout
    from .magics import current_fleet, current_metrics

    fleet = current_fleet()
    metrics = current_metrics()
    state = {"type": "state", "running": fleet is not None, "run": metrics.run_id if metrics else None,
             "engines": [], "spares": {"ready": 0, "starting": 0}, "checkpoints": []}
    if fleet is not None:
        streams = fleet.metrics.store.streams if fleet.metrics else {}
        state.update(world_size=fleet.world_size, backend=fleet.backend, run_dir=fleet.run_dir,
                     engines=[_engine_row(m, streams.get(m.rank)) for m in list(fleet.members)],
                     spares={"ready": len(fleet.spares), "starting": len(fleet._pending_spares)})
    if metrics is not None:
        folder = layout.checkpoints_dir(metrics.run_dir)
        for entry in layout.list_checkpoints(folder, clean=False):
            row = {"tag": entry.tag, "state": entry.state}
            if entry.manifest is not None:
                row.update(step=entry.manifest.step, world_size=entry.manifest.world_size,
                           strategy=entry.manifest.strategy, created=entry.manifest.created)
            state["checkpoints"].append(row)
    return state


def _engine_row(member, stream) -> dict:
    state = "starting" if stream is None or stream.pid != member.pid else ("busy" if stream.busy else "idle")
    if member.host == socket.gethostname() or member.host == "localhost":
        try:
            if psutil.Process(member.pid).status() == psutil.STATUS_ZOMBIE:
                state = "dead"
        except psutil.Error:
            state = "dead"
    elif stream is not None and time.time() - stream.beat_at > SILENT_AFTER_S:
        state = "silent"
    memory = (stream.memory if stream is not None else {}) or {}
    return {"rank": member.rank, "engine": member.engine_id, "pid": member.pid, "host": member.host,
            "device": member.device, "state": state,
            "memory_mb": memory.get("cuda_max_mb", memory.get("rss_mb"))}


def _points(records) -> list[list]:
    """``[rank, step, time, scalars, samples_per_s]`` per record: what the curves need."""
    return [[r.rank, r.step, r.time, r.scalars, r.system.get("samples_per_s")] for r in records]


class PanelConnection:
    """One open panel: sends state and metrics from a thread, runs its actions."""

    def __init__(self, ipython, comm) -> None:
        self.ipython, self.comm = ipython, comm
        self.closed = threading.Event()
        self.sent_state = None
        self.last_error = None
        self.run, self.sent_records = None, 0
        comm.on_msg(self.on_msg)
        comm.on_close(lambda _msg: self.closed.set())
        self.thread = threading.Thread(target=self._publish, name="workbench-panel", daemon=True)
        self.thread.start()

    def on_msg(self, msg) -> None:
        data = msg["content"]["data"]
        self.comm.send(run_action(self.ipython, data))
        self.publish_once()  # the change the action made, without waiting for the next poll

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
        from .magics import current_metrics

        with _publish_lock:
            state = snapshot()
            text = json.dumps(state, sort_keys=True, default=str)
            if text != self.sent_state:
                self.comm.send(json.loads(text))
                self.sent_state = text
            metrics = current_metrics()
            if metrics is None:
                return
            records = metrics.store.records
            if metrics.run_id != self.run:
                self.run, self.sent_records = metrics.run_id, max(0, len(records) - HISTORY)
            new = records[self.sent_records:len(records)]
            if new:
                self.comm.send({"type": "metrics", "run": self.run, "points": _points(new)})
                self.sent_records += len(new)


_publish_lock = threading.Lock()  # the thread and an action's immediate update send in order


def register(ipython) -> bool:
    """Register the panel's comm target in this kernel; False outside a kernel."""
    try:
        from comm import get_comm_manager
    except ImportError:
        return False
    kernel = getattr(ipython, "kernel", None)
    if kernel is None:
        return False

    def opened(comm, msg) -> None:
        client = str((msg["content"].get("data") or {}).get("client", comm.comm_id))
        previous = _comms.pop(client, None)
        if previous is not None:  # the same browser tab, reloaded: its old comm has no listener
            previous.close()
        _comms[client] = PanelConnection(ipython, comm)

    get_comm_manager().register_target(TARGET, opened)
    return True


def close_all() -> None:
    for connection in list(_comms.values()):
        connection.close()
    _comms.clear()
