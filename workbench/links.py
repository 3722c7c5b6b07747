"""Cutting a rank's links to a lost host, so that a collective waiting on it ends now.

When a host is lost or cut off (:meth:`workbench.kernel.pool.EnginePool.lost_hosts_now`), the other
ranks may be blocked in a collective with its ranks, until the process group's timeout
(``--pg-timeout``, 300 s by default). gloo's ``abort()`` does not end a collective already
waiting, and these ranks are busy, so they cannot be asked through ipyparallel. The kernel
writes an order into the run's folder (shared by every host); each rank's metrics sender
thread, which runs while the main thread waits, looks for orders every 0.2 s and shuts down
its own TCP connections to those addresses: the collective fails at once with "Connection
closed", the rank's Python state is kept.

Both sides use this module: the kernel writes orders (:func:`order_cut`), the ranks carry
them out (:class:`CutOrders`).
"""

from __future__ import annotations

import json
import os
import socket
import time

FOLDER = "control"


def order_cut(run_dir: str, host: str, addresses: list[str]) -> None:
    """Kernel side: tell every rank to cut its connections to ``addresses`` (``host``'s)."""
    folder = os.path.join(run_dir, FOLDER)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"cut-{host}-{time.time_ns()}.json")  # a host lost again is a new order
    with open(path + ".tmp", "w") as f:
        json.dump({"host": host, "addresses": addresses}, f)
    os.replace(path + ".tmp", path)


def route_address(peer: str) -> str:
    """This host's address on the interface that routes to ``peer`` (OSError if none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))  # UDP: chooses the route, sends nothing
        return probe.getsockname()[0]


def addresses_of(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)})
    except OSError:
        return []


class CutOrders:
    """Rank side: carries out each order once (called from the metrics sender thread)."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.run_dir: str | None = None

    def check(self, run_dir: str | None) -> list[str]:
        """Carry out new orders under ``run_dir``; returns the addresses whose links were cut.
        Orders older than this process's joining the run are not for it (an engine started
        later, perhaps on that host once it is back)."""
        folder = os.path.join(run_dir, FOLDER) if run_dir else None
        if folder is None or not os.path.isdir(folder):
            self.run_dir = run_dir
            return []
        names = [e.name for e in os.scandir(folder) if e.name.endswith(".json")]
        if run_dir != self.run_dir:
            self.run_dir, self.done = run_dir, set(names)
            return []
        cut = []
        for name in names:
            if name in self.done:
                continue
            self.done.add(name)
            entry_path = os.path.join(folder, name)
            try:
                with open(entry_path) as f:
                    addresses = json.load(f)["addresses"]
            except (OSError, ValueError, KeyError):
                continue
            cut += shut_down_connections(set(addresses))
        return cut


def shut_down_connections(addresses: set[str]) -> list[str]:
    """Shut down this process's TCP connections to ``addresses``; returns those it cut."""
    import psutil

    cut = []
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.ip in addresses and conn.fd >= 0:
            try:
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut.append(f"{conn.raddr.ip}:{conn.raddr.port}")
            except OSError:
                pass
    return cut
