"""The kernel's side of live metrics: :mod:`.collector` (the zmq receiver of the ranks' records),
:mod:`.store`, :mod:`.live` (the run's sinks, a cell's display), :mod:`.dashboard` (the widget),
:mod:`.summary` (text), :mod:`.stragglers`, :mod:`.step_rows`, and the sinks: :mod:`.sinks`
(the :class:`~.sinks.Sink` base, the registry, ``metrics.jsonl``), :mod:`.wandb_sink`,
:mod:`.tensorboard_sink`. The ranks' side is :mod:`workbench.metrics`."""
