"""What ``%fleet status`` shows: a row per rank (engine, pid, host, device, state, memory)
and the table made of them. Kernel side."""

from __future__ import annotations

from workbench.kernel.pool import EnginePool
from workbench.kernel.processes import resident_memory
from workbench.rank import engine

COLUMNS = ["rank", "engine", "pid", "host", "device", "state", "memory"]


def status_rows(pool: EnginePool, slow: dict[int, float] | None = None) -> list[dict]:
    """One row per rank. A rank is busy while the controller has a request queued for it;
    an idle rank reports its own memory, a busy one is measured from outside. A rank in
    ``slow`` (a straggler: :mod:`workbench.kernel.metrics.stragglers`) shows ``slow 1.6×``."""
    slow = slow or {}
    registered = set(pool.client.ids)
    queues = pool.queue_status()
    states = {}
    for m in pool.members:
        states[m.rank] = "dead"
        if m.engine_id in registered:
            states[m.rank] = "busy" if queues.get(m.engine_id, {}).get("queue", 0) else "idle"
    idle = [m for m in pool.members if states[m.rank] == "idle"]
    asked = {m.rank: pool.client[m.engine_id].apply_async(engine.memory_report) for m in idle}
    rows = []
    for m in pool.members:
        try:
            memory = asked[m.rank].get(timeout=2) if m.rank in asked else resident_memory(m.local, m.pid)
        except Exception:
            memory = resident_memory(m.local, m.pid)
        rows.append({"rank": m.rank, "engine": m.engine_id, "pid": m.pid, "host": m.host,
                     "device": m.device, "memory": memory,
                     "state": f"slow {slow[m.rank]:.1f}×" if m.rank in slow and states[m.rank] != "dead"
                     else states[m.rank]})
    return rows


def status_table(rows: list[dict]) -> str:
    """The ranks' table; with several hosts, grouped under a line per host (its node rank)."""
    if not rows:
        return "no fleet is running; start one with %fleet start -n 2"
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    hosts = list(dict.fromkeys(r["host"] for r in rows))
    for node, host in enumerate(hosts):
        mine = [r for r in rows if r["host"] == host]
        if len(hosts) > 1:
            lines.append(f"node {node}: {host} ({len(mine)} rank{'s' if len(mine) > 1 else ''})")
        lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in COLUMNS) for r in mine]
    return "\n".join(lines)
