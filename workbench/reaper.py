"""Kills a fleet's processes if the kernel that owns them dies without stopping it.

A normal ``Fleet.stop()`` (and interpreter exit) stops engines and controller
itself; this watcher covers a kernel that is SIGKILLed or crashes. It is
started by the fleet as ``python -m workbench.reaper OWNER_PID RUNTIME_DIR`` in
its own session, polls the owner, and exits when the runtime folder is gone
(the fleet stopped cleanly) or after cleaning up.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import psutil

PIDS_FILE = "pids.json"
POLL_S = 0.5
IPP_MARKERS = ("ipyparallel", "ipengine", "ipcontroller", "workbench.rank.template")


def write_pids(runtime_dir: str, pids: list[int]) -> None:
    """Record the fleet's process ids (owner-only file, replaced atomically)."""
    path = os.path.join(runtime_dir, PIDS_FILE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(sorted(set(pids)), f)
    os.replace(tmp, path)


def _read_pids(runtime_dir: str) -> list[int]:
    try:
        with open(os.path.join(runtime_dir, PIDS_FILE)) as f:
            return [int(p) for p in json.load(f)]
    except (OSError, ValueError):
        return []


def _fleet_processes(pids: list[int]) -> list[psutil.Process]:
    """The recorded processes that are still ipyparallel processes, with their children."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if not any(m in " ".join(proc.cmdline()) for m in IPP_MARKERS):
                continue  # the pid was reused by something else
            found.extend(proc.children(recursive=True))
            found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_all(runtime_dir: str) -> None:
    """Kill every recorded process of the fleet (and their children), except the caller, and
    remove the runtime folder."""
    procs = [p for p in _fleet_processes(_read_pids(runtime_dir)) if p.pid != os.getpid()]
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def watch(owner_pid: int, runtime_dir: str) -> None:
    while os.path.isdir(runtime_dir):
        try:
            owner_alive = psutil.Process(owner_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            owner_alive = False
        if not owner_alive:
            kill_all(runtime_dir)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
