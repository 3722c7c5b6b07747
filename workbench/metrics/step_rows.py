"""Kernel side: the rank records of one step folded into one row, for the sinks that
plot a run (wandb, TensorBoard).

A row holds the mean across ranks under the scalar's own name and each rank's
value under ``rank<N>/<name>``. A step's row is ready once every rank logged it;
:meth:`StepRows.drain` gives the incomplete ones too (the end of a cell).
"""

from __future__ import annotations

import statistics


class StepRows:
    def __init__(self, world_size) -> None:
        self.world_size = world_size  # a callable: the fleet's size can change
        self._pending: dict[int, dict[int, dict]] = {}  # step -> rank -> values

    def add(self, records) -> list[tuple[int, dict]]:
        """Take ``records``; return the ``(step, row)`` of every step now complete."""
        world = self.world_size()
        ready = []
        for record in records:
            ranks = self._pending.setdefault(record.step, {})
            ranks[record.rank] = {**record.scalars, **record.system}
            if len(ranks) >= world:
                ready.append((record.step, _row(self._pending.pop(record.step))))
        return ready

    def drain(self) -> list[tuple[int, dict]]:
        """The rows of the steps that not every rank logged, as they are."""
        rows = [(step, _row(self._pending[step])) for step in sorted(self._pending)]
        self._pending.clear()
        return rows


def _row(ranks: dict[int, dict]) -> dict:
    row = {}
    for name in sorted({name for values in ranks.values() for name in values}):
        row[name] = statistics.fmean(values[name] for values in ranks.values() if name in values)
        for rank, values in sorted(ranks.items()):
            if name in values:
                row[f"rank{rank}/{name}"] = values[name]
    return row
