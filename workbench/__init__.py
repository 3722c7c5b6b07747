"""workbench: interactive distributed PyTorch training from Jupyter.

Kernel side: :class:`Fleet` and the ``%fleet`` / ``%%distributed`` magics
(``%load_ext workbench``). Engine side, inside cells: ``workbench`` is defined.
"""

import sys
import types

from . import checkpoint, llm
from .errors import CheckpointError, FleetError, OptionsError, WorkbenchError
from .execution import DistributedCellError
from .fleet import Fleet
from .metrics import log, progress
from .strategies import CellOptions

__all__ = [
    "CheckpointError",
    "checkpoint",
    "llm",
    "CellOptions",
    "DistributedCellError",
    "Fleet",
    "FleetError",
    "OptionsError",
    "WorkbenchError",
    "load_ipython_extension",
    "unload_ipython_extension",
    "log",
    "progress",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from .magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    from .magics import unload_ipython_extension as unload

    unload(ipython)


class _Module(types.ModuleType):
    @property
    def step(self) -> int:
        """Training steps this rank has completed (``workbench.log`` calls or optimizer steps)."""
        from .metrics.logger import LOGGER

        return LOGGER.step

    @step.setter
    def step(self, value: int) -> None:
        from .metrics.logger import LOGGER

        LOGGER.step = int(value)


sys.modules[__name__].__class__ = _Module
