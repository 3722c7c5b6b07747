"""Kernel side: every record of a fleet run, per rank, in arrival order."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from ..messages import MetricsMessage

SYSTEM_FIELDS = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "comm_s", "rss_mb", "cuda_max_mb",
                 "gpu_util_pct", "gpu_mem_used_mb")


def json_safe(value):
    """``value`` with NaN and ±inf (a diverged loss) as ``None``: standard JSON, which browsers parse
    (Python writes them as bare ``NaN``/``Infinity``, which ``JSON.parse`` rejects)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@dataclass
class Record:
    """One ``workbench.log`` call (or one optimizer step) on one rank."""

    time: float  # on the rank, seconds since the epoch
    arrived: float  # in the kernel, seconds since the epoch
    rank: int
    step: int
    scalars: dict
    system: dict

    def to_json(self) -> dict:
        return {"time": self.time, "rank": self.rank, "step": self.step, "scalars": self.scalars,
                "system": self.system}


@dataclass
class RankStream:
    """What one rank's sender told us: the last sequence number, drops, the total."""

    pid: int = 0
    seq: int = 0
    dropped: int = 0
    lost: int = 0  # sequence gaps not explained by drops
    total: int | None = None
    beat_at: float = 0.0  # arrival of the last message (heartbeats included), seconds since the epoch
    cell: int = 0  # from the heartbeat: the rank's cell counter when it was sent
    stalled_s: float | None = None  # from the heartbeat: seconds the rank's cell has made no progress
    stack: str | None = None  # the rank's main thread, sent while it is stalled or waits in a collective
    waiting_in: str | None = None  # from the heartbeat: the torch.distributed call the rank is inside
    waiting_s: float | None = None  # ... and for how long it had been there when the beat left
    busy: bool = False  # from the heartbeat: the rank is running a cell's code
    memory: dict = field(default_factory=dict)  # from the last message: rss_mb (and cuda_max_mb on GPU)


@dataclass
class MetricsStore:
    records: list[Record] = field(default_factory=list)
    streams: dict[int, RankStream] = field(default_factory=dict)
    cells_done: dict[int, int] = field(default_factory=dict)  # engine pid -> the cell counter of its last reply
    seq_by_pid: dict[int, int] = field(default_factory=dict)  # engine pid -> its last record that arrived

    def __post_init__(self) -> None:
        self.changed = threading.Condition()

    def add(self, message: MetricsMessage, arrived: float) -> list[Record]:
        """Add one sender message; return its records."""
        rank = message["rank"]
        if rank is None and not message["records"]:
            return []  # the heartbeat of an engine that has no rank yet
        new = [Record(t, arrived, rank, step, scalars, {**system, **message["memory"]})
               for t, _seq, step, scalars, system in message["records"]]
        with self.changed:
            stream = self.streams.setdefault(rank, RankStream())
            if stream.pid != message["pid"]:  # a new engine process for this rank
                stream.pid, stream.seq, stream.dropped = message["pid"], 0, 0
            first = message["records"][0][1] if message["records"] else stream.seq + 1
            gap = first - stream.seq - 1
            newly_dropped = message["dropped"] - stream.dropped
            stream.lost += max(0, gap - newly_dropped)
            stream.dropped = message["dropped"]
            stream.total = message.get("total")
            if message["records"]:
                stream.seq = self.seq_by_pid[message["pid"]] = message["records"][-1][1]
            stream.memory = message.get("memory") or stream.memory
            beat = message.get("beat")
            if beat is not None:
                stream.beat_at, stream.stalled_s, stream.stack = arrived, beat["stalled_s"], beat["stack"]
                stream.cell, stream.busy = beat["cell"], bool(beat.get("busy"))
                stream.waiting_in, stream.waiting_s = beat.get("waiting_in"), beat.get("waiting_s")
            self.records.extend(new)
            self.changed.notify_all()
        return new

    def wait_for(self, seqs: dict[int, tuple[int, int]], timeout: float) -> bool:
        """Wait until each rank's records up to (pid, seq) have arrived; False on timeout. By
        engine pid, not rank: an engine's earlier records may have come under another rank
        (a rescale renumbers ranks)."""

        def arrived():
            return all(self.seq_by_pid.get(pid, 0) >= seq for pid, seq in seqs.values())

        with self.changed:
            return self.changed.wait_for(arrived, timeout)

    def since(self, start: int) -> list[Record]:
        with self.changed:
            return self.records[start:]

    def __len__(self) -> int:
        return len(self.records)

    def dropped(self) -> int:
        return sum(s.dropped + s.lost for s in self.streams.values())
