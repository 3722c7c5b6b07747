"""Kernel side: ``<run>/logs/``, what each rank printed, kept with the run.

``rank-<N>.log`` gets the stdout and stderr of every cell that ran on rank N,
under a header naming the cell and its time, as the cell ends. ``engine-<id>.log``
gets an engine process's own output (what it printed outside cells: a crash's
traceback, a C library's messages) when the engine stops or is replaced: it
lived in the runtime folder, which goes away with the fleet.
Files are private to the user (0600), like the rest of the run folder.
"""

from __future__ import annotations

import os
import time

from workbench.kernel.output import settle_bars

LOGS = "logs"


def logs_dir(run_dir: str) -> str:
    return os.path.join(run_dir, LOGS)


class RankLogs:
    """Appends each rank's cell output and each engine's process output under ``<run>/logs``."""

    def __init__(self, run_dir: str) -> None:
        self.folder = logs_dir(run_dir)
        self.errors: list[str] = []  # a full disk costs the log, never the cell

    def cell(self, title: str, texts: dict[int, tuple[str, str]]) -> None:
        """Append the ``(stdout, stderr)`` of a cell on each rank."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for rank, (out, err) in texts.items():
            out, err = settle_bars(out), settle_bars(err)
            parts = [f"── {title} · {stamp} ──\n", _ended(out)]
            if err:
                parts += ["── stderr ──\n", _ended(err)]
            self._append(f"rank-{rank}.log", "".join(parts))

    def engine(self, name: str, text: str) -> None:
        """Keep an engine process's own output (``name`` says which engine set)."""
        if text.strip():
            self._append(f"engine-{name}.log", _ended(text))

    def _append(self, name: str, text: str) -> None:
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(self.folder, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8", errors="replace") as f:
                f.write(text)
        except OSError as exc:
            self.errors.append(f"{name}: {exc.strerror or exc}")


def _ended(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
