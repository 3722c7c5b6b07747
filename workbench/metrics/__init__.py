"""Live metrics: ``workbench.log`` on the ranks, a collector, dashboard and sinks in the kernel.

Engine side: :mod:`.logger` (``log``, ``progress``, the sender) and :mod:`.comm` (the time
with collectives in flight); :mod:`workbench.instrument` measures what ``prepare`` returns.
Kernel side: :mod:`.collector` (zmq receiver), :mod:`.store`, :mod:`.live`
(the run's sinks, per-cell display), :mod:`.dashboard` (widget), :mod:`.summary` (text),
:mod:`.sinks` (the :class:`~.sinks.Sink` base, the registry, ``metrics.jsonl``),
:mod:`.wandb_sink`, :mod:`.tensorboard_sink`.
"""

from .logger import config, log, progress

__all__ = ["config", "log", "progress"]
