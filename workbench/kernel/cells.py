"""Kernel side: a cell's way onto the ranks (``Fleet.execute`` / ``Fleet.run``).

Before a cell runs: the ranks it names and its options are checked against the fleet, and
ranks replaced by fresh engines (or a scale or recover stopped half-way) refuse cells until
``%fleet recover``. While it runs, :mod:`workbench.kernel.execution` streams and supervises
it. After it: setup and training cells are recorded for replay and export. What happens
around a cell (recovering a lost rank first or after, naming stragglers) is the fleet's:
:meth:`workbench.kernel.fleet.Fleet.execute`; the setup replay of a resize or recovery
(:mod:`workbench.kernel.elastic`) runs its cells here too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from workbench.errors import FleetError, OptionsError
from workbench.kernel import execution
from workbench.kernel.metrics.store import WINDOW
from workbench.options import CellOptions
from workbench.rank import engine

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet


class Cells:
    """A fleet's way of running cells: checks, the run on the ranks, the record, the session.

    Built from the parts it uses: the engine pool (which ranks exist) and the session state (what
    is remembered of cells, which ranks have no state yet). The run's metrics and record are
    replaced at every start, so they are read through ``fleet``, as is how a cell reaches the
    ranks (:func:`workbench.kernel.execution.run_on_ranks`)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.pool = fleet.pool
        self.session = fleet.session

    def targets(self, ranks) -> list[int]:
        """``ranks`` (None: all) checked against the fleet: a sorted list, or a one-line error."""
        fleet = self.fleet
        if not fleet.running:
            raise FleetError("no fleet is running; start one with %fleet start -n 2 (or Fleet(n=2).start())")
        if fleet.parked is not None:  # the next command brings a parked fleet back
            fleet.unpark()
        world = self.pool.world_size
        if ranks is None:
            return list(range(world))
        if isinstance(ranks, int):
            ranks = [ranks]
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise OptionsError(f"ranks are whole numbers, e.g. ranks=[0, 1] (got {list(ranks)!r})")
        ranks = sorted(set(ranks))
        bad = [r for r in ranks if not 0 <= r < world]
        if bad or not ranks:
            raise OptionsError(
                f"rank {','.join(map(str, bad)) or '(none)'} is out of range: this fleet has ranks "
                f"0-{world - 1}"
            )
        return ranks

    def admit(self, options: CellOptions, ranks, setup: bool = False) -> list[int]:
        """The cell's target ranks (a one-line error if they or its options do not fit the fleet)."""
        fleet = self.fleet
        chosen = self.targets(ranks)
        world = self.pool.world_size
        options.validate(fleet.device_type, world, fleet.nodes, fleet.backend)
        if (options.custom_parallel or options.comm_hook) and len(chosen) != world:
            raise OptionsError("hsdp, --tp, --pp and --comm-hook need every rank (they build the mesh or DDP "
                               "on the whole group); drop --ranks")
        if setup and ranks is not None and len(chosen) != world:
            raise OptionsError("a --setup cell runs on every rank (it is replayed on all of them); drop --ranks")
        return chosen

    def _refuse_unrecovered(self) -> None:
        """A replaced rank has an empty namespace, or a scale or recover stopped half-way: running
        cells before %fleet recover would leave ranks at different steps and parameters (and end in
        a collective timeout)."""
        self.session.refuse_if_unfinished()
        fresh = self.session.fresh_ranks
        if fresh and not self.session.replaying:
            raise FleetError(f"rank {','.join(map(str, fresh))} was replaced by a fresh engine (empty "
                             "namespace); run %fleet recover first, so that every rank has the same state")

    def execute(self, code: str, options: CellOptions, *, ranks=None, timeout: float | None = None,
                return_value: bool = False, show_output: bool = True, setup: bool = False,
                show_all_progress: bool = False, stop_on_nan: bool = False) -> execution.CellResult:
        """Run ``code`` as a cell on ``ranks`` (see ``Fleet.execute``); raises
        :class:`~workbench.kernel.execution.DistributedCellError` when a rank failed or was lost."""
        chosen = self.admit(options, ranks, setup)
        self._refuse_unrecovered()
        name = self.session.next_cell_name()
        args = (code, options.to_dict(), name, return_value, not return_value, stop_on_nan)
        with self._recorded(name, options, chosen, setup) as replies:
            result = execution.run_on_ranks(self.fleet, chosen, engine.run_cell, args, timeout=timeout,
                                            show_output=show_output, title=name, all_progress=show_all_progress)
            replies.update(result.replies)
        self.session.cell_ran(code, options, setup=setup, on_every_rank=ranks is None)
        self.fleet.adopt_spares()  # spares that registered while the cell ran get warm now
        return result

    @contextlib.contextmanager
    def _recorded(self, name: str, options: CellOptions, ranks: list[int], setup: bool):
        """The cell in the run's record (``run.json``): flags, ranks, start, end, status, its
        scalars' last values, and the ranks' ``workbench.config``."""
        fleet = self.fleet
        started, first = time.time(), len(fleet.metrics.store) if fleet.metrics else 0
        status, error, replies = "ok", "", {}
        try:
            yield replies  # the ranks' replies, filled in by the caller
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except BaseException as exc:
            status, error = "failed", str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise
        finally:
            if fleet.record is not None:
                flags = {k: v for k, v in options.to_dict().items() if v != getattr(CellOptions(), k)}
                if setup:
                    flags["setup"] = True
                store = fleet.metrics.store if fleet.metrics else None
                records = store.since(max(first, len(store) - WINDOW)) if store is not None else []
                fleet.record_config({k: v for rank in sorted(replies, reverse=True)  # rank 0's value wins
                                     for k, v in (replies[rank].get("config") or {}).items()})
                fleet.record.cell(name, flags, ranks, started, status, error, records)

    def call(self, function: Callable, args: tuple, kwargs: dict, options: CellOptions, *, ranks=None,
             timeout: float | None = None, show_output: bool = True) -> execution.CellResult:
        """Call ``function(*args, **kwargs)`` on ``ranks``, with a cell's names defined."""
        chosen = self.admit(options, ranks)
        self._refuse_unrecovered()
        return execution.run_on_ranks(
            self.fleet, chosen, engine.run_function, (function, args, kwargs, options.to_dict()), timeout=timeout,
            show_output=show_output, title=f"function {getattr(function, '__qualname__', 'call')}",
        )
