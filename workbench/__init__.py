"""workbench: interactive distributed PyTorch training from Jupyter.

Kernel side: :class:`Fleet` and the ``%fleet`` / ``%%distributed`` magics
(``%load_ext workbench``). Engine side, inside cells: ``workbench`` is defined.
"""

from .errors import FleetError, OptionsError, WorkbenchError
from .execution import DistributedCellError
from .fleet import Fleet
from .strategies import CellOptions

__all__ = [
    "CellOptions",
    "DistributedCellError",
    "Fleet",
    "FleetError",
    "OptionsError",
    "WorkbenchError",
    "load_ipython_extension",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from .magics import load_ipython_extension as load

    load(ipython)
