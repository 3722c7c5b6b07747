"""Kernel side: a fleet run's records as TensorBoard event files.

``<run>/tensorboard/`` holds the mean across ranks of every scalar and
``<run>/tensorboard/rank<N>/`` each rank's own values, so TensorBoard draws one
chart per scalar with a line per rank and one for the mean
(``%tensorboard --logdir workbench-runs`` shows every run). Written with
tensorboard's own event writer (no torch in the kernel); on when the
``tensorboard`` package is installed (``pip install torch-workbench[tensorboard]``).
"""

from __future__ import annotations

import os
import time

from ..runs import make_private
from .step_rows import StepRows

FOLDER = "tensorboard"


def tensorboard_available() -> bool:
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardSink:
    """Writes a fleet run's records under ``<run>/tensorboard``; files appear at the first record."""

    def __init__(self, run_dir: str, world_size) -> None:
        self.folder = os.path.join(run_dir, FOLDER)
        self.rows = StepRows(world_size)
        self._writers: dict[str, object] = {}  # "" (the mean) or "rank<N>" -> EventFileWriter

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
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
