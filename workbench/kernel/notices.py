"""workbench's own notices in the kernel: one line each on stderr (``workbench: ...``), sent
through the ``workbench`` logger, so that Python's logging can silence, filter or redirect them
(``logging.getLogger("workbench").setLevel(logging.WARNING)``); errors stay exceptions."""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("workbench")


class _StderrLine(logging.Handler):
    """``workbench: <message>`` on whatever ``sys.stderr`` is at the time (a notebook cell's)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"workbench: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a notice never breaks what it reports on
            self.handleError(record)


if not any(isinstance(h, _StderrLine) for h in LOGGER.handlers):
    LOGGER.addHandler(_StderrLine())
    LOGGER.propagate = False  # shown once; set it True (and drop the handler) to route through your own
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)


def notice(text: str) -> None:
    """Tell the user something that is not an error, in one line."""
    LOGGER.info(text)


def debug(text: str) -> None:
    """Keep a detail for whoever turns on ``logging.getLogger("workbench").setLevel(logging.DEBUG)``."""
    LOGGER.debug(text)
