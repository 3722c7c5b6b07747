"""Kernel side: a fleet run's records as TensorBoard event files.

``<run>/tensorboard/`` holds the mean across ranks of every scalar and
``<run>/tensorboard/rank<N>/`` each rank's own values, so TensorBoard draws one
chart per scalar with a line per rank and one for the mean
(``%tensorboard --logdir workbench-runs`` shows every run). Written with
tensorboard's own event writer (no torch in the kernel); on when the
``tensorboard`` package is installed (``pip install torch-workbench[tensorboard]``).

tensorboard's writer checksums each event in pure Python (about 0.1 ms a rank a step
in the kernel, which shares the cores with the ranks), so it gets every step up to
``ROW_BURST`` in a burst, then at most ``ROWS_PER_S`` a second: every step of steps of
50 ms or more, a sample of faster ones (always each cell's last); ``metrics.jsonl``
keeps every record.
"""

from __future__ import annotations

import os
import time

from workbench.kernel.metrics.sinks import RunInfo, Sink
from workbench.kernel.metrics.step_rows import StepRows
from workbench.kernel.runs import make_private

FOLDER = "tensorboard"
ROWS_PER_S = 20.0
ROW_BURST = 256


def _event(summary):
    from tensorboard.compat.proto.event_pb2 import Event

    return Event(wall_time=time.time(), step=0, summary=summary)


def _hparams_summaries(hparams: dict, metric_tags: list[str]) -> list:
    """TensorBoard's HParams records (experiment, session start and end) for ``hparams``, the
    protobufs its plugin reads (as torch's ``add_hparams`` writes them; no TensorFlow needed)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    start, infos = plugin_data_pb2.SessionStartInfo(), []
    for name, value in hparams.items():
        if isinstance(value, bool):
            start.hparams[name].bool_value, kind = value, "DATA_TYPE_BOOL"
        elif isinstance(value, (int, float)):
            start.hparams[name].number_value, kind = float(value), "DATA_TYPE_FLOAT64"
        elif value is not None:
            start.hparams[name].string_value, kind = str(value), "DATA_TYPE_STRING"
        else:
            continue
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metric_tags])
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))

    def summary(tag, **data):
        content = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **data).SerializeToString()
        plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=content)
        return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])

    return [summary(metadata.EXPERIMENT_TAG, experiment=experiment),
            summary(metadata.SESSION_START_INFO_TAG, session_start_info=start),
            summary(metadata.SESSION_END_INFO_TAG, session_end_info=end)]


class TensorBoardSink(Sink):
    """Writes a fleet run's records under ``<run>/tensorboard``; files appear at the first record."""

    kind = "tensorboard"

    def __init__(self, run: RunInfo) -> None:
        self.location = self.folder = os.path.join(run.run_dir, FOLDER)
        self.rows = StepRows(run.world_size, ROWS_PER_S, ROW_BURST)
        self._writers: dict[str, object] = {}  # "" (the mean) or "rank<N>" -> EventFileWriter
        self.hparams: dict = {}  # the run's config, written at close for TensorBoard's HParams tab
        self._tags: set[str] = set()  # the mean's scalar tags: the HParams tab's metrics
        self.update_config(run.config)

    def update_config(self, values: dict) -> None:
        """Config values as TensorBoard's HParams take them (a list becomes its text; nested
        options are left out)."""
        self.hparams.update({k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in values.items()
                             if v is not None and not isinstance(v, dict)})

    def write(self, records) -> None:
        self._write(self.rows.add(records))

    def _write(self, rows) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time()
        for step, row in rows:
            by_writer: dict[str, list] = {}
            for name, value in row.items():
                head, _, tag = name.partition("/")
                if not (head.startswith("rank") and tag):
                    head, tag = "", name
                by_writer.setdefault(head, []).append(Summary.Value(tag=tag, simple_value=float(value)))
                if not head:
                    self._tags.add(tag)
            for head, values in by_writer.items():
                self._writer(head).add_event(Event(wall_time=now, step=step, summary=Summary(value=values)))

    def _writer(self, name: str):
        writer = self._writers.get(name)
        if writer is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            folder = os.path.join(self.folder, name) if name else self.folder
            os.makedirs(folder, mode=0o700, exist_ok=True)
            writer = self._writers[name] = EventFileWriter(folder)
        return writer

    def flush(self) -> None:
        """End of a cell: steps that not every rank logged are written as they are, files flushed."""
        self._write(self.rows.drain())
        for writer in self._writers.values():
            writer.flush()
        make_private(self.folder)

    def close(self) -> None:
        self.flush()
        if self.hparams and self._tags:
            for summary in _hparams_summaries(self.hparams, sorted(self._tags)):
                self._writer("").add_event(_event(summary))
            self._writer("").flush()
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
