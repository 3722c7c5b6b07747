"""Kernel side: the live metrics widget (ipywidgets 8 + bqplot).

bqplot is the plotting library: its marks are ipywidgets, so a refresh sends
only the arrays that changed over the widget comm (no image re-rendering as
with matplotlib/ipympl, no separate JS stack as with plotly), and it ships a
prebuilt JupyterLab 4 extension. The dashboard is refreshed by the kernel
while a cell runs, at most ``REFRESH_S`` apart.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict

from workbench.kernel.metrics.store import MetricsStore, Record
from workbench.kernel.metrics.stragglers import slow_ranks
from workbench.kernel.metrics.summary import per_rank, steps_per_second

REFRESH_S = 0.25  # at most ~4 updates a second
MAX_POINTS = 500  # per line; longer series are averaged in buckets
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf"]
SYSTEM_PLOTS = {  # plot -> (system field, title, unit, scale), the first field that was recorded wins
    "step": [("step_time_s", "step time", "ms", 1e3)],
    "throughput": [("tokens_per_s", "throughput", "tokens/s", 1.0), ("samples_per_s", "throughput", "samples/s", 1.0)],
    "comm": [("comm_s", "communication per step", "ms", 1e3)],
    "memory": [("cuda_max_mb", "CUDA max allocated", "MiB", 1.0), ("rss_mb", "memory (RSS)", "MiB", 1.0)],
    "gpu": [("gpu_util_pct", "GPU utilisation (NVML)", "%", 1.0)],
}
OPTIONAL_PLOTS = ("gpu",)  # shown only once a rank recorded the field (NVML on a GPU)


def downsample(xs: list, ys: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """At most ``limit`` points: each bucket's lowest and highest point, in step order, so a spike
    (a loss jump, a slow step) stays on the chart; the first and last point are kept."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    size = -(-len(xs) // max(1, (limit - 2) // 2))
    out_x, out_y = [xs[0]], [ys[0]]
    for i in range(1, len(xs) - 1, size):
        bucket = range(i, min(i + size, len(xs) - 1))
        low, high = min(bucket, key=ys.__getitem__), max(bucket, key=ys.__getitem__)
        for j in sorted({low, high}):
            out_x.append(xs[j])
            out_y.append(ys[j])
    out_x.append(xs[-1])
    out_y.append(ys[-1])
    return out_x, out_y


class _Plot:
    """One bqplot figure with a line per rank (or one mean line), its legend below the chart.

    ``robust``: a few outliers (the warm-up step, often 100x the steady one) do not set the
    y axis; the axis spans the steady values and the title says what is off the chart.
    """

    def __init__(self, title: str, height: str = "220px", y_label: str = "", robust: bool = False) -> None:
        import bqplot as bq
        import ipywidgets as widgets

        self.title, self.robust = title, robust
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale()
        axes = [bq.Axis(scale=self.x_scale, label="step", tick_format="d"),
                bq.Axis(scale=self.y_scale, side="left", label=y_label,
                        tick_format=".4~g")]
        self.figure = bq.Figure(marks=[], axes=axes, title=title,
                                fig_margin={"top": 40, "bottom": 40, "left": 70, "right": 20},
                                layout=widgets.Layout(height=height, width="100%"))
        self.legend = widgets.HTML()
        self.note = widgets.HTML()  # what is off the chart: under it, never cut like a long title
        self.widget = widgets.VBox([self.figure, self.note, self.legend])
        self.lines: dict[str, object] = {}

    def show(self, series: dict[str, tuple[list, list]]) -> None:
        """``series``: label -> (steps, values); lines are added as labels appear."""
        import bqplot as bq

        if set(series) != set(self.lines):
            self.lines = {
                label: bq.Lines(scales={"x": self.x_scale, "y": self.y_scale}, labels=[label],
                                colors=[COLORS[i % len(COLORS)]])
                for i, label in enumerate(series)
            }
            self.figure.marks = list(self.lines.values())
            self.legend.value = legend_html(list(series)) if len(series) > 1 else ""
        for label, (xs, ys) in series.items():
            xs, ys = downsample(xs, ys)
            line = self.lines[label]
            with line.hold_sync():
                line.x, line.y = xs, ys
        steps = [x for xs, _ in series.values() for x in xs]
        if steps:  # a range of a few steps would repeat integer ticks ("0 0 0 1 1 1")
            with self.x_scale.hold_sync():
                self.x_scale.min, self.x_scale.max = float(min(steps)), float(max(max(steps), min(steps) + 4))
        if self.robust:  # each line's first point is its warm-up step (shown apart in the summary too)
            self._fit([y for _, ys in series.values() for y in ys], [y for _, ys in series.values() for y in ys[1:]])

    def _fit(self, values: list[float], steady: list[float]) -> None:
        """The y axis from 0 to above the ``steady`` values; outliers are clipped and counted."""
        top = steady_top(steady)
        clipped = sum(1 for v in values if top is not None and v > top)
        with self.y_scale.hold_sync():
            self.y_scale.min = 0.0 if values and min(values) >= 0 else None
            self.y_scale.max = top if clipped else None
        self.note.value = (f"<small>{clipped} of {len(values)} points above the chart (max {max(values):.4g})"
                           "</small>" if clipped else "")


def steady_top(values: list[float], factor: float = 3.0) -> float | None:
    """An axis top for ``values`` that leaves out rare outliers: ``factor`` x the median (the
    warm-up step is typically 100x a steady one), never below the 99th percentile, so at least
    99 % of the points are on the chart."""
    if len(values) < 5:
        return None
    ordered = sorted(values)
    median, p99 = statistics.median(ordered), ordered[math.ceil(0.99 * (len(ordered) - 1))]
    return max(median * factor, p99) * 1.05 if median > 0 else None


def legend_html(labels: list[str]) -> str:
    """A legend under the chart: a colour swatch per line."""
    items = "".join(
        f'<span style="margin-right:12px;white-space:nowrap"><span style="display:inline-block;width:14px;'
        f'height:3px;vertical-align:middle;margin-right:4px;background:{COLORS[i % len(COLORS)]}"></span>{label}</span>'
        for i, label in enumerate(labels))
    return f'<div class="workbench-legend" style="font-size:12px;padding-left:70px">{items}</div>'


class Dashboard:
    """Progress bars per rank, curves of any logged scalar, and system measurements.

    A cell's dashboard (``first_record``: where the cell's records start) shows that cell
    only and keeps its numbers once the cell ended: it is refreshed while its cell runs and
    never after. The whole run's (``first_record=0``) is what ``%metrics`` shows.
    """

    def __init__(self, store: MetricsStore, run_id: str, first_record: int = 0) -> None:
        import ipywidgets as widgets

        self.store = store
        self.run_id = run_id
        self.what = "whole run" if first_record == 0 else "this cell"
        self._seen = first_record
        self._first = first_record
        self._cell_start = first_record
        self._scalars: dict[str, dict[int, tuple[list, list]]] = defaultdict(dict)
        self._system: dict[str, dict[int, tuple[list, list]]] = defaultdict(dict)
        self._last_refresh = 0.0
        self.header = widgets.HTML()
        self.progress = widgets.VBox()
        self._bars: dict[int, tuple] = {}
        self.choice = widgets.Dropdown(description="scalar", options=[], layout=widgets.Layout(width="260px"))
        self.mode = widgets.ToggleButtons(options=["per rank", "mean of ranks"], value="per rank")
        self.scalar_plot = _Plot("", height="280px")
        self.system_plots = {plot: _Plot(f"{fields[-1][1]} ({fields[-1][2]})", y_label=fields[-1][2], robust=True)
                             for plot, fields in SYSTEM_PLOTS.items()}
        self.choice.observe(lambda _change: self._draw_scalar(), "value")
        self.mode.observe(lambda _change: self._draw_scalar(), "value")
        grid = widgets.GridBox([p.widget for p in self.system_plots.values()],
                               layout=widgets.Layout(grid_template_columns="1fr 1fr"))
        self.widget = widgets.VBox([self.header, self.progress, widgets.HBox([self.choice, self.mode]),
                                    self.scalar_plot.widget, grid])
        self.refresh(force=True)

    def cell_started(self, first_record: int) -> None:
        """Progress bars and rates describe the cell whose records start at ``first_record``."""
        self._cell_start = first_record

    def refresh(self, force: bool = False) -> None:
        """Take in new records and redraw; rate-limited unless ``force``."""
        now = time.monotonic()
        if not force and now - self._last_refresh < REFRESH_S:
            return
        self._last_refresh = now
        new = self.store.since(self._seen)
        self._seen += len(new)
        for record in new:
            self._take(record)
        names = list(self._scalars)
        if names != list(self.choice.options):
            keep = self.choice.value
            self.choice.options = names
            self.choice.value = keep if keep in names else (names[0] if names else None)
        self._draw_scalar()
        for plot, fields in SYSTEM_PLOTS.items():
            field, title, unit, scale = next((f for f in fields if f[0] in self._system), fields[-1])
            series = self._system.get(field, {})
            if plot in OPTIONAL_PLOTS:
                self.system_plots[plot].widget.layout.display = None if field in self._system else "none"
            self.system_plots[plot].title = f"{title} ({unit})"
            self.system_plots[plot].figure.axes[1].label = unit
            self.system_plots[plot].show({f"rank {r}": (xs, [y * scale for y in ys])
                                          for r, (xs, ys) in sorted(series.items())})
        self._draw_progress()

    def _take(self, record: Record) -> None:
        for target, values in ((self._scalars, record.scalars), (self._system, record.system)):
            for name, value in values.items():
                xs, ys = target[name].setdefault(record.rank, ([], []))
                xs.append(record.step)
                ys.append(value)

    def _draw_scalar(self) -> None:
        name = self.choice.value
        self.scalar_plot.title = self.scalar_plot.figure.title = (
            name or "nothing logged yet: call workbench.log(loss=...) in a cell")
        if name is None:
            self.scalar_plot.show({})
            return
        per = self._scalars[name]
        if self.mode.value == "per rank":
            self.scalar_plot.show({f"rank {r}": xy for r, xy in sorted(per.items())})
            return
        by_step: dict[int, list] = defaultdict(list)
        for xs, ys in per.values():
            for x, y in zip(xs, ys, strict=True):
                by_step[x].append(y)
        steps = sorted(by_step)
        self.scalar_plot.show({"mean": (steps, [statistics.fmean(by_step[s]) for s in steps])})

    def _draw_progress(self) -> None:
        import ipywidgets as widgets

        cell = per_rank(self.store.since(self._cell_start))
        slow = slow_ranks(cell)
        for rank, records in cell.items():
            if rank not in self._bars:
                bar = widgets.IntProgress(min=0, max=1, layout=widgets.Layout(width="40%"))
                label = widgets.Label()
                self._bars[rank] = (bar, label)
                self.progress.children = [widgets.HBox([widgets.Label(f"rank {r}"), *self._bars[r]])
                                          for r in sorted(self._bars)]
            bar, label = self._bars[rank]
            stream = self.store.streams.get(rank)
            total = stream.total if stream else None
            label.value = progress_label(records, total) + (f" · slow {slow[rank]:.1f}×" if rank in slow else "")
            done = records[-1].step + 1
            bar.max = max(total or done, 1)
            bar.value = min(done, bar.max)
            bar.bar_style = "warning" if rank in slow else "success" if total and done >= total else "info"
        records = len(self.store) - self._first  # the whole run's, or this cell's: not the last cell's
        dropped = self.store.dropped()
        self.header.value = (f"<b>workbench</b> run <code>{self.run_id}</code> · {self.what} · {len(cell)} ranks · "
                             f"{records} records" + (f" · <b>{dropped} dropped</b>" if dropped else ""))

    def curve(self, name: str, rank: int) -> tuple[list, list]:
        """The (steps, values) the scalar plot shows for ``rank`` (for tests and scripts)."""
        if self.choice.value != name:
            self.choice.value = name
        line = self.scalar_plot.lines.get(f"rank {rank}")
        return (list(line.x), list(line.y)) if line is not None else ([], [])


def progress_label(records: list[Record], total: int | None) -> str:
    """tqdm-like: ``step 40/100 · 7.9 steps/s · ETA 0:07``; the rate leaves the first (warm-up)
    step out, as the summary does."""
    done = records[-1].step + 1
    rate = steps_per_second(records[1:] or records)
    text = f"step {done}/{total}" if total else f"step {done}"
    if rate:
        text += f" · {rate:.1f} steps/s"
        if total and total > done:
            eta = int((total - done) / rate)
            text += f" · ETA {eta // 60}:{eta % 60:02d}"
    return text
