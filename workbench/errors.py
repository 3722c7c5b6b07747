"""Exceptions that workbench raises in the kernel.

Every message is one line that tells the user what to do; the magics turn
:class:`WorkbenchError` into IPython's one-line ``UsageError``.
"""


class WorkbenchError(Exception):
    """Base class: a problem the user can fix, described in one line."""


class FleetError(WorkbenchError):
    """The fleet cannot do what was asked (not running, already running, ...)."""


class OptionsError(WorkbenchError, ValueError):
    """A flag or argument has a value that cannot work."""


class CheckpointError(WorkbenchError):
    """A checkpoint cannot be saved, found or restored; nothing was changed."""


def require_whole(value, name: str, minimum: int) -> None:
    """An :class:`OptionsError` unless ``value`` is a whole number >= ``minimum`` (``name``: the flag)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise OptionsError(f"{name} must be a whole number >= {minimum} (got {value!r})")
