"""Kernel side: a fleet run's metrics, and what a cell shows of them.

:class:`FleetMetrics` owns the collector, the sinks and the dashboard of one
fleet run. :class:`CellWatch` follows one cell: it shows the dashboard as soon
as the cell's first record arrives (in a Jupyter kernel), refreshes it while
the cell runs, waits at the end until every record the ranks sent has arrived,
and prints the text summary (what nbconvert and scripts keep).
"""

from __future__ import annotations

import os

from workbench.kernel.metrics.collector import MetricsCollector
from workbench.kernel.metrics.sinks import JSONL_NAME, JsonlSink, RunInfo, Sink, sink_factory
from workbench.kernel.metrics.store import WINDOW
from workbench.kernel.metrics.summary import non_finite, summary_text
from workbench.kernel.metrics.tensorboard_sink import TensorBoardSink
from workbench.kernel.metrics.wandb_sink import WandbSink, wandb_enabled
from workbench.kernel.notices import notice
from workbench.kernel.output import in_kernel
from workbench.options import installed

ARRIVAL_WAIT_S = 3.0  # a cell waits this long at most for its last records


def open_sinks(run: RunInfo, wandb: bool | None, tensorboard: bool | None, extra: list[str] = ()) -> list[Sink]:
    """The run's sinks: ``metrics.jsonl`` first, then wandb and TensorBoard (None: where
    installed), then ``extra`` by name."""
    sinks: list[Sink] = [JsonlSink(os.path.join(run.run_dir, JSONL_NAME))]
    if wandb_enabled() if wandb is None else wandb:
        sinks.append(WandbSink(run))
    if installed("tensorboard") if tensorboard is None else tensorboard:
        sinks.append(TensorBoardSink(run))
    sinks += [sink_factory(name)(run) for name in extra]
    return sinks


class FleetMetrics:
    """One fleet run's metrics: its sinks (:mod:`.sinks`), the collector that feeds them, the dashboard."""

    def __init__(self, run_id: str, run_dir: str, runtime_dir: str, world_size, config: dict,
                 wandb: bool | None = None, tensorboard: bool | None = None, sinks: list[str] = (),
                 network: bool = False) -> None:
        self.run_id = run_id
        self.run_dir = run_dir
        self.sinks = open_sinks(RunInfo(run_id, run_dir, world_size, config), wandb, tensorboard, sinks)  # as opened
        self.collector = MetricsCollector(run_dir, runtime_dir, self.sinks, network=network)
        self._dashboard = None

    def update_config(self, values: dict) -> None:
        """The run's config grew: every sink still writing is told."""
        for sink in self.collector.sinks:
            sink.update_config(values)

    def locations(self) -> dict[str, str | None]:
        """Where each sink writes, by its kind (``metrics.jsonl``, ``wandb``, ``tensorboard``, ...)."""
        return {sink.kind: sink.location for sink in self.sinks}

    @property
    def store(self):
        return self.collector.store

    @property
    def address(self) -> str:
        return self.collector.address

    @property
    def jsonl_path(self) -> str:
        return next(sink.path for sink in self.sinks if isinstance(sink, JsonlSink))

    def dashboard(self):
        """The whole run's dashboard (``%metrics``; created on first use, live while cells run)."""
        if self._dashboard is None:
            from workbench.kernel.metrics.dashboard import Dashboard

            self._dashboard = Dashboard(self.store, self.run_id)
        return self._dashboard

    def display_dashboard(self, dashboard=None) -> None:
        """Show ``dashboard`` (default: the whole run's) under the current cell."""
        from IPython.display import display

        dashboard = dashboard or self.dashboard()
        dashboard.refresh(force=True)
        display({
            "application/vnd.jupyter.widget-view+json": {
                "model_id": dashboard.widget.model_id, "version_major": 2, "version_minor": 0,
            },
            "text/plain": f"workbench metrics dashboard for run {self.run_id} (live in Jupyter; "
                          "a text summary follows each cell that logs)",
        }, raw=True)

    def summary(self, first_record: int = 0) -> str:
        """The summary of the records from ``first_record`` on (the newest WINDOW of them, saying so)."""
        start = max(first_record, len(self.store) - WINDOW)
        text = summary_text(self.store.since(start), self.run_id, self.store.dropped())
        if start > first_record:
            text += (f"\n(over the newest {WINDOW:,} of {len(self.store) - first_record:,} records; "
                     "all are in metrics.jsonl)")
        return text

    def watch(self, show_output: bool) -> "CellWatch":
        return CellWatch(self, show_output)

    def close(self) -> None:
        self.collector.close()


class CellWatch:
    """One cell's metrics: its own dashboard (shown at its first record, refreshed while it
    runs, then left as it ended), and the whole run's one kept live if ``%metrics`` showed it."""

    def __init__(self, metrics: FleetMetrics, show_output: bool) -> None:
        self.metrics = metrics
        self.first = len(metrics.store)
        self.show_output = show_output
        self.live = show_output and in_kernel()
        self.dashboard = None
        if metrics._dashboard is not None:
            metrics._dashboard.cell_started(self.first)

    def poll(self) -> None:
        """While the cell runs (kernel's main thread): show and refresh the dashboards."""
        if not self.live or len(self.metrics.store) <= self.first:
            return
        if self.dashboard is None:
            from workbench.kernel.metrics.dashboard import Dashboard

            self.dashboard = Dashboard(self.metrics.store, self.metrics.run_id, first_record=self.first)
            self.metrics.display_dashboard(self.dashboard)
        self.dashboard.refresh()
        if self.metrics._dashboard is not None:
            self.metrics._dashboard.refresh()

    def finish(self, replies: dict[int, dict]) -> None:
        """After every rank replied: wait for its last records, flush sinks, summarise."""
        expected = {}
        for rank, reply in replies.items():
            sent = reply.get("metrics") if isinstance(reply, dict) else None
            if sent:
                self.metrics.store.cells_done[sent["pid"]] = sent["cell"]
            if sent and sent["seq"]:
                expected[rank] = (sent["pid"], sent["seq"])
        arrived = self.metrics.store.wait_for(expected, ARRIVAL_WAIT_S) if expected else True
        self.metrics.collector.flush()
        notes = self.metrics.collector.take_errors()
        if not arrived:
            notes.append(f"metrics: some records had not arrived {ARRIVAL_WAIT_S:g} s after the cell ended; "
                         "they will still be written to metrics.jsonl")
        if len(self.metrics.store) > self.first:  # a diverged loss is said once, in the cell's output
            notes += non_finite(self.metrics.store.since(max(self.first, len(self.metrics.store) - WINDOW)))
        for note in notes:
            notice(note)
        if len(self.metrics.store) <= self.first:
            return
        if self.live:
            self.poll()  # shows it, if records arrived after the last poll
            self.dashboard.refresh(force=True)
            if self.metrics._dashboard is not None:
                self.metrics._dashboard.refresh(force=True)
        if self.show_output:
            print(self.metrics.summary(self.first))
