"""One-line reasons for a failed checkpoint save or load: the OS reason where there is one
(no space, read-only, permissions), else the error's last line. Engine side."""

from __future__ import annotations

import shutil
import traceback

OS_REASONS = ("No space left", "Read-only file system", "Permission denied", "Disk quota exceeded")


def describe(exc: BaseException) -> str:
    """One line for a failed save or load: the OS reason if there is one, else the last line."""
    texts = [str(exc)]
    for failure in getattr(exc, "failures", {}).values():  # DCP's CheckpointException: one per rank
        texts.append("".join(traceback.format_exception(failure)) if isinstance(failure, BaseException)
                     else str(failure))
    for text in texts:
        for line in text.splitlines():
            if any(reason in line for reason in OS_REASONS):
                return line.strip()
    lines = [line for line in texts[0].strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]


def explain(exc: BaseException, folder: str, state_dict: dict) -> str:
    """``describe``, or the disk space when the write failed for lack of it (the zip
    writer in torch.save can turn ENOSPC into an unrelated-looking error)."""
    reason = describe(exc)
    if any(r in reason for r in OS_REASONS):
        return reason
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return reason
    needed = nbytes(state_dict)
    if free < needed:
        return (f"No space left on device: {free // 1024} KiB free in {folder}, "
                f"this rank's state needs about {needed // 1024} KiB")
    return reason


def nbytes(value) -> int:
    if hasattr(value, "numel") and hasattr(value, "element_size"):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0
