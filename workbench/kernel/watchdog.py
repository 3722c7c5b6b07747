"""Kernel side: tell a hung rank while a cell runs.

A hung rank is alive but makes no progress. Its heartbeat (sent by the rank's
metrics thread, :mod:`workbench.metrics.logger`) shows it in one of two ways:

- no heartbeat for ``hang_timeout`` seconds (and for at least
  ``FROZEN_AFTER_MIN_S``, a few heartbeat intervals, so that a short timeout
  does not mistake a late beat for a frozen rank): the process is frozen
  (stopped, swapped out, or in native code that holds the GIL);
- the cell made progress (a forward, an optimizer step, a collective launched,
  ``workbench.log``) and then none for ``hang_timeout`` seconds (and at least
  ``FROZEN_AFTER_MIN_S``: progress is only seen through heartbeats, so a pause of
  a second or two between steps is not a hang): stuck in a collective or a
  deadlock. The heartbeat then carries the rank's stack.

A cell that never showed progress (loading data, a plain ``time.sleep``) is
not judged by the second sign; ``--timeout`` covers it.

A third sign needs no timeout: a mismatched collective. Once one rank has
finished the cell, a collective over the whole group can no longer complete; if
every rank still running has been inside a torch.distributed call (or a backward
of a DDP model that syncs its gradients, where DDP waits for its all-reduce) with
nothing moving (no byte through its collectives' threads, no new activity) for
``MISMATCH_AFTER_S``, and that long since the peer finished, the cell is stopped at
once instead of waiting out ``--pg-timeout``. (On a thin link the last all-reduce
of a cell can end seconds after the first rank's: its bytes still flow.) (Ranks waiting together in a collective of a sub-group that
leaves out the finished rank, for that long, would be judged the same way.) The cell runner
(:mod:`workbench.kernel.execution`) stops a hung cell like a failed one, and kills and
replaces a hung rank that does not stop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.metrics.logger import BEAT_EVERY_S

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet

FROZEN_AFTER_MIN_S = 3 * BEAT_EVERY_S  # a busy 2-core machine delays a beat by a second or more
MISMATCH_AFTER_S = 5.0


@dataclass
class Hang:
    rank: int
    why: str
    stack: str | None = None
    frozen: bool = False  # no heartbeat at all (rather than no progress)
    ename: str = "Hung"  # or "MismatchedCollective"

    def text(self) -> str:
        where = f"\nwhere its main thread was:\n{self.stack.rstrip()}" if self.stack else ""
        what = "hung" if self.ename == "Hung" else "waits in a collective no peer will join"
        return f"rank {self.rank} {what}: {self.why}{where}"


class HangWatch:
    """Judges the pending ranks of one cell from their heartbeats."""

    def __init__(self, fleet: Fleet, ranks: list[int], timeout: float | None) -> None:
        self.timeout = timeout
        self.store = fleet.metrics.store
        self.pids = {r: fleet.member(r).pid for r in ranks}
        # a heartbeat is about this cell if the rank's cell counter has passed its last reply's
        self.before = {r: self.store.cells_done.get(pid, -1) for r, pid in self.pids.items()}
        self.started = time.time()
        self.peer_finished_at: float | None = None

    def _stream(self, rank: int):
        """The rank's stream if it comes from the engine running this cell."""
        stream = self.store.streams.get(rank)
        return stream if stream is not None and stream.pid == self.pids[rank] else None

    def mismatched(self, pending, finished: list[int]) -> list[Hang]:
        """Ranks all waiting in a collective after some peer finished the cell."""
        if not finished or not pending:
            return []
        now = time.time()
        if self.peer_finished_at is None:
            self.peer_finished_at = now
        if now - self.peer_finished_at < MISMATCH_AFTER_S:
            return []
        waits = {}
        for rank in sorted(pending):
            stream = self._stream(rank)
            if stream is None or stream.cell <= self.before[rank] or not stream.waiting_in:
                return []
            waited = (stream.waiting_s or 0.0) + now - stream.beat_at
            if waited < MISMATCH_AFTER_S:
                return []
            waits[rank] = (stream, waited)
        done = ",".join(map(str, finished))
        return [Hang(rank, f"waited {waited:.0f} s in {stream.waiting_in} while rank {done} had "
                           "already finished the cell (every rank of the group must make the same collective "
                           "calls in the same order)", stream.stack, ename="MismatchedCollective")
                for rank, (stream, waited) in waits.items()]

    def check(self, pending) -> list[Hang]:
        if not self.timeout:
            return []
        now = time.time()
        hangs = []
        for rank in sorted(pending):
            stream = self._stream(rank)
            silent = now - max(stream.beat_at if stream else 0.0, self.started)
            if silent > max(self.timeout, FROZEN_AFTER_MIN_S):
                hangs.append(Hang(rank, f"no heartbeat for {silent:.0f} s (the process is frozen: stopped, or in "
                                        "native code that holds the GIL)", frozen=True))
            elif (stream is not None and stream.cell > self.before[rank] and stream.stalled_s is not None
                  and stream.stalled_s + silent > max(self.timeout, FROZEN_AFTER_MIN_S)):
                hangs.append(Hang(rank, f"no progress for {stream.stalled_s + silent:.0f} s (no forward, optimizer "
                                        "step, collective or workbench.log): stuck in a collective or a "
                                        "deadlock", stream.stack))
        return hangs
