"""Kernel side: where a fleet run's records go, besides the kernel's own store.

A sink is a :class:`Sink`: the collector's receiver thread (the only thread that
touches sinks) gives it every batch of records as it arrives, asks it to flush at the
end of each cell and closes it with the run. The built-in ones: ``metrics.jsonl``
(always: old records are read back from it), ``wandb`` and ``tensorboard`` (on where
their package is installed; ``--no-wandb``, ``--no-tensorboard`` turn them off).

Another sink is one file: a :class:`Sink` subclass and a factory that takes the run
(:class:`RunInfo`), registered under a name, in code (:func:`register_sink`) or as an
entry point of the ``workbench.sinks`` group in a package's metadata; ``%fleet start
--sink NAME`` (``Fleet(sinks=["NAME"])``) turns it on for a run::

    class PrintSink(Sink):
        def write(self, records):
            print(len(records), "records")

    register_sink("print", lambda run: PrintSink())
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from workbench.errors import OptionsError
from workbench.kernel.metrics.store import Record, json_safe

JSONL_NAME = "metrics.jsonl"
ENTRY_POINTS = "workbench.sinks"


class SinkPaused(Exception):
    """A sink could not write now (a full disk) but keeps what it was given and tries again."""


class Sink:
    """Where records go. ``write`` is called from the collector's thread with each batch of
    records as they arrive; a slow sink delays only the other sinks, never the ranks. Raise
    :class:`SinkPaused` to keep data for later; any other exception ends this sink alone."""

    location: str | None = None  # where it writes (``%metrics --path``), once known

    @property
    def kind(self) -> str:
        """Its name in ``%metrics --path``: the class name without ``Sink``."""
        return type(self).__name__.removesuffix("Sink").lower()

    def write(self, records: list[Record]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """The end of a cell: write out what is held back."""

    def close(self) -> None:
        """The end of the run."""
        self.flush()

    def update_config(self, values: dict) -> None:
        """The run's config grew (``workbench.config``, ``Fleet.record_config``)."""


@dataclass
class RunInfo:
    """What a sink's factory is given: the run's id and folder, its size (a callable: the
    fleet's size can change) and its config (name, ranks, backend, options, user config)."""

    run_id: str
    run_dir: str
    world_size: Callable[[], int]
    config: dict


SinkFactory = Callable[[RunInfo], Sink]
_REGISTERED: dict[str, SinkFactory] = {}


def register_sink(name: str, factory: SinkFactory) -> None:
    """Make ``factory`` the sink ``name`` (``--sink name``)."""
    _REGISTERED[name] = factory


def sink_names() -> list[str]:
    """The sinks ``--sink`` can turn on: registered in code or as ``workbench.sinks`` entry points."""
    return sorted({*_REGISTERED, *(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS))})


def sink_factory(name: str) -> SinkFactory:
    """The factory of the sink ``name``: registered in code, else a ``workbench.sinks`` entry point."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    check_sink_names([name])
    return next(ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS) if ep.name == name).load()


def check_sink_names(names: list[str]) -> None:
    """One line for a name no sink has, before anything starts."""
    known = sink_names()
    for name in names:
        if name not in known:
            raise OptionsError(f"no sink named {name!r}; known: {', '.join(known) or 'none'} (register_sink(name, "
                               "factory) or a 'workbench.sinks' entry point adds one)")


class JsonlSink(Sink):
    """``<run>/metrics.jsonl``: one JSON object a line (time, rank, step, scalars, system).

    A failed write (disk full) keeps the unwritten bytes, up to MAX_PENDING_BYTES, and the
    next write tries them first, so the file goes on once space is back."""

    MAX_PENDING_BYTES = 64 * 2**20
    kind = "metrics"

    def __init__(self, path: str) -> None:
        self.location = self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._pending = b""
        self.dropped_bytes = 0

    def write(self, records) -> None:
        data = self._pending + b"".join(_line(r) for r in records)
        self._pending = b""
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            if len(data) > self.MAX_PENDING_BYTES:  # keep the newest whole lines
                cut = data.find(b"\n", len(data) - self.MAX_PENDING_BYTES) + 1
                self.dropped_bytes += cut
                data = data[cut:]
            self._pending = data
            raise SinkPaused(f"metrics.jsonl: {exc.strerror or exc}; {len(data)} bytes kept, written once "
                             "there is space again") from None

    def flush(self) -> None:
        if self._pending:
            self.write([])

    def close(self) -> None:
        os.close(self._fd)


_ENCODE = json.JSONEncoder(allow_nan=False).encode


def _line(record) -> bytes:
    """One line of metrics.jsonl: orjson (a tenth of the json module's time; NaN and inf become
    null, as standard JSON has neither), the json module for what orjson refuses (huge ints)."""
    data = record.to_json()
    try:
        return orjson.dumps(data, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        return (_ENCODE(json_safe(data)) + "\n").encode()
