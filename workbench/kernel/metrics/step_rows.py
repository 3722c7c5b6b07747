"""Kernel side: the rank records of one step folded into one row, for the sinks that
plot a run (wandb, TensorBoard).

A row holds the mean across ranks under the scalar's own name and each rank's
value under ``rank<N>/<name>``. A step's row is ready once every rank logged it;
:meth:`StepRows.drain` gives the incomplete ones too (the end of a cell).

A sink that costs CPU per row (in the kernel, which shares the machine with the
ranks) gives a rate: rows then go out as they come up to ``burst`` of them, then
at most ``rows_per_s`` a second; a step that finds no slot is skipped (its row is
never built), except that the newest one skipped always goes out at the end of
the cell. Every record stays in ``metrics.jsonl`` either way.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.kernel.metrics.store import Record


class StepRows:
    def __init__(self, world_size, rows_per_s: float | None = None, burst: int = 0) -> None:
        self.world_size = world_size  # a callable: the fleet's size can change
        self.rows_per_s = rows_per_s
        self.burst = burst
        self._pending: dict[int, dict[int, Record]] = {}  # step -> rank -> its record
        self._slots = float(burst)  # rows that may go out now
        self._refilled = time.monotonic()
        self._held: tuple[int, dict] | None = None  # the newest complete step that found no slot
        self.skipped = 0  # steps whose row was not written (rate)

    def add(self, records) -> list[tuple[int, dict]]:
        """Take ``records``; return the ``(step, row)`` of every step now complete (and let through)."""
        world = self.world_size()
        pending, ready = self._pending, []
        for record in records:
            step = record.step
            ranks = pending.get(step)
            if ranks is None:
                ranks = pending[step] = {}
            ranks[record.rank] = record
            if len(ranks) >= world:
                ready.append((step, pending.pop(step)))
        return self._let_through(ready)

    def drain(self) -> list[tuple[int, dict]]:
        """The end of a cell: the rows of the steps that not every rank logged, as they are, and
        the newest step the rate held back."""
        incomplete = [(step, self._pending[step]) for step in sorted(self._pending)]
        self._pending.clear()
        rows = self._let_through(incomplete)
        if self._held is not None:
            step, ranks = self._held
            self._held = None
            self.skipped -= 1
            rows.append((step, _row(ranks)))
        return rows

    def _let_through(self, steps: list) -> list[tuple[int, dict]]:
        if self.rows_per_s is None:
            return [(step, _row(ranks)) for step, ranks in steps]
        now = time.monotonic()
        self._slots = min(self.burst, self._slots + (now - self._refilled) * self.rows_per_s)
        self._refilled = now
        rows = []
        for step, ranks in steps:
            if self._slots >= 1:
                self._slots -= 1
                rows.append((step, _row(ranks)))
                if self._held is not None and self._held[0] <= step:
                    self._held = None  # a newer row went out: the held one stays skipped
            else:
                if self._held is None or self._held[0] <= step:
                    self._held = (step, ranks)
                self.skipped += 1
        return rows


def _row(ranks: dict[int, Record]) -> dict:
    merged = {rank: {**record.scalars, **record.system} for rank, record in sorted(ranks.items())}
    row = {}
    for name in sorted({name for values in merged.values() for name in values}):
        values = [v[name] for v in merged.values() if name in v]
        row[name] = sum(values) / len(values)
        for rank, v in merged.items():
            if name in v:
                row[f"rank{rank}/{name}"] = v[name]
    return row
