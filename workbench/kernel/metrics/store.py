"""Kernel side: every record of a fleet run, per rank, in arrival order.

The newest records stay in memory (a bounded window); older ones are read back from the run's
``metrics.jsonl`` (one line a record, in the same order) when a summary reaches back that far, so
a day-long run's kernel holds :data:`WINDOW` records at most.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from dataclasses import dataclass, field

from workbench.messages import MetricsMessage

WINDOW = 100_000  # records kept in memory (about 1 KiB each)
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


@dataclass(slots=True)
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
    """Records by arrival index (0 = the run's first); ``spill_path``: the run's metrics.jsonl,
    where records older than the window are read back from."""

    spill_path: str | None = None
    window: int = WINDOW
    streams: dict[int, RankStream] = field(default_factory=dict)
    cells_done: dict[int, int] = field(default_factory=dict)  # engine pid -> the cell counter of its last reply
    seq_by_pid: dict[int, int] = field(default_factory=dict)  # engine pid -> its last record that arrived

    def __post_init__(self) -> None:
        self.changed = threading.Condition()
        self._recent: list[Record] = []
        self._first = 0  # the arrival index of _recent[0]

    def add(self, message: MetricsMessage, arrived: float) -> list[Record]:
        """Add one sender message; return its records."""
        rank = message["rank"]
        if rank is None and not message["records"]:
            return []  # the heartbeat of an engine that has no rank yet
        new = [Record(t, arrived, rank, step, scalars, system) for t, _seq, step, scalars, system in message["records"]]
        if new and message["memory"]:  # sampled when the message left: the newest record's
            new[-1].system = {**new[-1].system, **message["memory"]}
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
            self._recent.extend(new)
            if len(self._recent) > self.window + self.window // 2:  # trim now and then, not every add
                cut = len(self._recent) - self.window
                del self._recent[:cut]
                self._first += cut
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

    def since(self, start: int, limit: int | None = None) -> list[Record]:
        """The records from arrival index ``start`` on, ``limit`` at most (those older than the
        window are read from disk: keep ``start`` within the window, or set a limit)."""
        with self.changed:
            first = self._first
            stop = len(self) if limit is None else min(len(self), start + limit)
            recent = self._recent[max(0, start - first):max(0, stop - first)]
        return (self._read_back(start, min(first, stop)) if start < first else []) + recent

    def _read_back(self, start: int, stop: int) -> list[Record]:
        if self.spill_path is None:
            return []
        try:
            with open(self.spill_path) as f:
                lines = list(itertools.islice(f, start, stop))
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                r = json.loads(line)
                records.append(Record(r["time"], r["time"], r["rank"], r["step"], r["scalars"], r["system"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a full disk
        return records

    def __len__(self) -> int:
        return self._first + len(self._recent)

    def dropped(self) -> int:
        return sum(s.dropped + s.lost for s in self.streams.values())
