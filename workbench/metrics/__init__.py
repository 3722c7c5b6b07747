"""Live metrics, the ranks' side: ``workbench.log``, ``workbench.progress``, ``workbench.config``.

:mod:`.logger` (the step counter, the records, the sender), :mod:`.comm` (the time with
collectives in flight), :mod:`.gpu`; :mod:`workbench.rank.instrument` measures what
``prepare`` returns. The kernel's side (collector, store, dashboard, sinks) is
:mod:`workbench.kernel.metrics`.
"""

from workbench.metrics.logger import config, log, progress

__all__ = ["config", "log", "progress"]
