"""workbench: interactive distributed PyTorch training from Jupyter.

Kernel side: :class:`Fleet` and the ``%fleet`` / ``%%distributed`` magics
(``%load_ext workbench``). Engine side, inside cells: ``workbench`` is defined.
"""

import importlib
import sys
import types

from workbench.errors import CheckpointError, FleetError, OptionsError, WorkbenchError

# Loaded on first use, so that ``import workbench`` on an engine (every cell does it) loads
# no kernel-side module: name -> (module, attribute or None for the module itself).
_LAZY = {
    "checkpoint": (".checkpoint", None),
    "llm": (".llm", None),
    "log": (".metrics", "log"),
    "config": (".metrics", "config"),
    "progress": (".metrics", "progress"),
    "tune": (".trials", "tune"),
    "CellOptions": (".options", "CellOptions"),
    "FleetOptions": (".options", "FleetOptions"),
    "DistributedCellError": (".kernel.execution", "DistributedCellError"),
    "Fleet": (".kernel.fleet", "Fleet"),
    "current_fleet": (".kernel.magics", "current_fleet"),
    "current_metrics": (".kernel.magics", "current_metrics"),
}

__all__ = [
    "CheckpointError",
    "checkpoint",
    "llm",
    "CellOptions",
    "FleetOptions",
    "DistributedCellError",
    "Fleet",
    "current_fleet",
    "current_metrics",
    "FleetError",
    "OptionsError",
    "WorkbenchError",
    "load_ipython_extension",
    "unload_ipython_extension",
    "log",
    "config",
    "progress",
    "tune",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from workbench.kernel.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    from workbench.kernel.magics import unload_ipython_extension as unload

    unload(ipython)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module, __name__)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Module(types.ModuleType):
    @property
    def step(self) -> int:
        """Training steps this rank has completed (``workbench.log`` calls or optimizer steps)."""
        from workbench.metrics.logger import LOGGER

        return LOGGER.step

    @step.setter
    def step(self, value: int) -> None:
        from workbench.metrics.logger import LOGGER

        LOGGER.step = int(value)


sys.modules[__name__].__class__ = _Module
