"""Kernel side: one wandb run per fleet run, logged by the kernel.

The kernel already receives every rank's records, so it logs one wandb run
for the whole fleet: the mean across ranks under the scalar's own name and
each rank's value under ``rank<N>/<name>``, one row per step. The
alternative, one wandb run per rank in a group, would start a wandb service
in every engine (seconds of start-up and memory per rank, network from the
training processes) and leave the cross-rank view to the wandb UI.

Without an API key (``WANDB_API_KEY`` or ``~/.netrc``) the run is offline,
so nothing ever prompts for a login. ``WANDB_MODE``, ``WANDB_PROJECT``,
``WANDB_DIR`` and the other wandb settings the user set are left alone;
``WANDB_MODE=disabled`` turns the sink off.

wandb's own guidance is to log under about once a second for its cost to stay negligible;
a row costs about a millisecond of CPU in the kernel and wandb's service, which on a small
machine comes out of the training (6 % of a 7 ms step here). So wandb gets every step's row
up to ``ROW_BURST`` in a burst, then at most ``ROWS_PER_S`` a second (and always each cell's
last step); ``metrics.jsonl`` keeps every record.
"""

from __future__ import annotations

import os

from workbench.kernel.metrics.sinks import RunInfo, Sink
from workbench.kernel.metrics.step_rows import StepRows
from workbench.kernel.runs import make_private
from workbench.options import installed

STEP_KEY = "workbench/step"
ROWS_PER_S = 4.0
ROW_BURST = 64


def wandb_mode() -> str | None:
    """The mode to ask for: None (the user's own setting, or online) or 'offline'."""
    if os.environ.get("WANDB_MODE"):
        return None
    if os.environ.get("WANDB_API_KEY"):
        return None
    try:
        import netrc

        hosts = netrc.netrc().hosts
        if any("wandb" in host for host in hosts):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


def wandb_enabled() -> bool:
    """The default: on where wandb is installed (the ``wandb`` extra) and not disabled."""
    return os.environ.get("WANDB_MODE", "").lower() != "disabled" and installed("wandb")


class WandbSink(Sink):
    """Writes a fleet run's records to wandb; the run starts at the first record."""

    def __init__(self, run: RunInfo) -> None:
        self.run_dir = run.run_dir
        self.run_id = run.run_id
        self.config = dict(run.config)
        self.run = None
        self.rows = StepRows(run.world_size, ROWS_PER_S, ROW_BURST)

    def _start(self):
        import wandb

        kwargs = {
            "project": os.environ.get("WANDB_PROJECT", "workbench"),
            "name": os.environ.get("WANDB_NAME", self.run_id),
            "config": self.config,
            "reinit": "create_new",  # never replaces a run the user has open in the kernel
            "settings": wandb.Settings(console="off", silent=True),
        }
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = self.run_dir
        mode = wandb_mode()
        if mode is not None:
            kwargs["mode"] = mode
        self.run = wandb.init(**kwargs)
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def update_config(self, values: dict) -> None:
        """The run's config grew (``workbench.config``): before the run starts it goes in at init."""
        self.config.update(values)
        if self.run is not None:
            self.run.config.update(values, allow_val_change=True)

    def write(self, records) -> None:
        if self.run is None:
            self._start()
        self._log(self.rows.add(records))

    def _log(self, rows) -> None:
        for step, row in rows:
            self.run.log({STEP_KEY: step, **row})

    def flush(self) -> None:
        """End of a cell: steps that not every rank logged are written as they are, and the
        cell's last step if the rate held it back."""
        self._log(self.rows.drain())
        self._make_private()

    def close(self) -> None:
        if self.run is not None:
            self.flush()
            self.run.finish()
            self._make_private()
            self.run = None

    def _make_private(self) -> None:
        make_private(os.path.join(self.run_dir, "wandb"))

    @property
    def location(self) -> str | None:
        """The wandb run's folder (what ``wandb sync`` takes), once the run has started."""
        return os.path.dirname(self.run.dir) if self.run is not None else None
