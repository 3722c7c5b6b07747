"""Kernel side of :meth:`Fleet.tune` / ``%fleet tune``: the trials on every rank
(:mod:`workbench.trials`), their table, and the fastest configuration made the defaults
of the next cells."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.kernel.notices import notice
from workbench.options import TuneOptions
from workbench.trials import TuneResult, tune

if TYPE_CHECKING:
    from workbench.kernel.fleet import Fleet


def tune_fleet(fleet: Fleet, step, model, batch, optimizer, options: TuneOptions) -> TuneResult:
    """Run :func:`workbench.trials.tune` on every rank; apply the fastest configuration that fit
    (``options.apply``): the fleet's ``cell_defaults`` and ``micro_batch_size`` on every rank."""
    options.validate(fleet.device_type, fleet.world_size, fleet.nodes)
    result: TuneResult = fleet.run(tune, step, model, batch, optimizer, options, options=fleet.cell_defaults)[0]
    best = result.best
    if best is None:
        notice("no configuration fit: every trial ran out of memory or was skipped; try smaller "
               "micro-batches (--micro-batches) or another strategy")
    elif options.apply:
        fleet.session.cell_defaults = best.cell_options(fleet.session.cell_defaults)
        fleet.push(micro_batch_size=best.micro_batch)
        print(f"workbench: the next cells run with {best.flags()} (a flag on a cell overrides it), and "
              f"micro_batch_size = {best.micro_batch} on every rank", flush=True)
    return result
