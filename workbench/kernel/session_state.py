"""Kernel side: what the kernel remembers of a fleet's session, with one owner.

The cells to replay (``--setup``) and to export (the last training cell), what cells fall
back to (``%fleet tune`` sets it), the automatic restarts spent, and which ranks are fresh
engines without the training state yet. :class:`~workbench.kernel.fleet.Fleet` holds one
:class:`SessionState` as ``fleet.session``; the modules that run cells, recover and scale
change it only through its methods.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import FleetError
from workbench.options import CellOptions


@dataclass
class SessionState:
    """A fleet's session: its cells, its defaults, its restarts, its ranks without state."""

    setup_cells: list[tuple[str, CellOptions]] = field(default_factory=list)
    """``(code, options)`` of each ``--setup`` cell, replayed on every rank after a resize or recovery."""
    training_cell: tuple[str, CellOptions] | None = None
    """The last other cell that ran on every rank (``%fleet export`` writes it)."""
    cell_defaults: CellOptions = field(default_factory=CellOptions)
    """What a cell's flags fall back to (``%fleet tune`` sets them)."""
    restarts: int = 0
    """Automatic recoveries spent (``--auto-recover`` allows ``--max-restarts``)."""
    cells_run: int = 0
    """Cells sent to the ranks so far (names them ``distributed-cell-N``)."""
    replaying: bool = False
    """The setup cells are being replayed (a resize or recovery): they run on fresh ranks too."""
    unfinished: Any = None
    """A scale or recover stopped half-way (:class:`workbench.kernel.elastic.Unfinished`): cells
    and resizes are refused until ``%fleet recover`` finishes it."""
    _fresh: list[int] = field(default_factory=list)

    # ------------------------------------------------------------------ cells
    def next_cell_name(self) -> str:
        self.cells_run += 1
        return f"distributed-cell-{self.cells_run}"

    def cell_ran(self, code: str, options: CellOptions, *, setup: bool, on_every_rank: bool) -> None:
        """Remember a cell that ran without error: a setup cell (once, replacing the same code) for
        replay, another cell that every rank ran as the training cell."""
        if setup:
            self.setup_cells = [c for c in self.setup_cells if c[0] != code] + [(code, options)]
        elif on_every_rank and not self.replaying:
            self.training_cell = (code, options)

    def forget_setup(self) -> None:
        """No setup cell is replayed any more (a resize then restores into what the ranks hold)."""
        self.setup_cells = []

    @contextlib.contextmanager
    def replay(self):
        """While the setup cells run again on every rank; yields them."""
        self.replaying = True
        try:
            yield list(self.setup_cells)
        finally:
            self.replaying = False

    # ------------------------------------------------------------------ a command that changes the fleet
    @contextlib.contextmanager
    def changing(self, unfinished):
        """While a command changes the fleet: an exception (KeyboardInterrupt included) leaves
        ``unfinished`` behind, for ``%fleet recover`` to finish."""
        self.unfinished = unfinished
        yield
        self.unfinished = None

    def refuse_if_unfinished(self) -> None:
        """A one-line error while a scale or recover is unfinished (its own setup replay goes on)."""
        if self.unfinished is not None and not self.replaying:
            raise FleetError(self.unfinished.describe())

    # ------------------------------------------------------------------ ranks without state
    @property
    def fresh_ranks(self) -> list[int]:
        """Ranks replaced by fresh engines that do not have the training state yet: cells wait
        for ``%fleet recover``."""
        return list(self._fresh)

    def replaced(self, ranks: list[int], world_size: int) -> None:
        """``ranks`` now run on fresh engines. When every rank did, they agree again (all empty)."""
        self._fresh = sorted(set(self._fresh) | set(ranks))
        if len(self._fresh) >= world_size:
            self._fresh = []

    def every_rank_has_state(self) -> None:
        """A restore (or a fresh start) gave every rank the same state."""
        self._fresh = []

    # ------------------------------------------------------------------ restarts
    def take_restart(self, max_restarts: int) -> int | None:
        """Spend one automatic restart: its number, or None when ``max_restarts`` are spent."""
        if self.restarts >= max_restarts:
            return None
        self.restarts += 1
        return self.restarts
