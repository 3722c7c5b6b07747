"""``./workbench-runs/<run-id>/``: where a fleet run keeps what it produces.

One folder per fleet run (``metrics.jsonl``, ``checkpoints/``, ``wandb/``).
``WORKBENCH_RUNS_DIR`` moves the parent folder. Folders are private to the
user (0700): they hold training data and state.
"""

from __future__ import annotations

import os
import secrets
import time

from workbench.errors import FleetError

RUNS_DIR_ENV = "WORKBENCH_RUNS_DIR"
RUNS_FOLDER = "workbench-runs"  # in the working folder (a notebook's kernel: next to the notebook)


def runs_root(base: str | None = None) -> str:
    return os.path.abspath(base or os.environ.get(RUNS_DIR_ENV) or RUNS_FOLDER)


def new_run_dir(base: str | None = None) -> tuple[str, str]:
    """Create a fresh run folder; return ``(run_id, path)``."""
    root = runs_root(base)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        return _new_run_folder(root)
    except OSError as exc:
        raise FleetError(f"cannot create the run folder under {root}: {exc.strerror or exc}; pass "
                         f"runs_dir= (or set {RUNS_DIR_ENV}) to a writable folder") from None


def _new_run_folder(root: str) -> tuple[str, str]:
    while True:
        run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        path = os.path.join(root, run_id)
        try:
            os.mkdir(path, 0o700)
            return run_id, path
        except FileExistsError:
            continue


def make_private(root: str) -> None:
    """Make the tree under ``root`` owner-only (folders 0700, files 0600), like the rest of a run
    folder: libraries that write into it (wandb, TensorBoard) use the process umask (0644)."""
    for folder, _, files in os.walk(root):
        for path, mode in [(folder, 0o700), *((os.path.join(folder, f), 0o600) for f in files)]:
            try:
                if not os.path.islink(path):
                    os.chmod(path, mode)
            except OSError:
                pass  # removed meanwhile by the library that wrote it
