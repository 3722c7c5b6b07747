"""The kernel side: everything that runs in the notebook's kernel (or the script that drives a fleet).

:class:`~workbench.kernel.fleet.Fleet` owns the engines (:mod:`.pool`, :mod:`.processes`,
:mod:`.launchers`), the session state (:mod:`.session_state`), the run's metrics
(:mod:`.metrics`) and checkpoints (:mod:`.checkpoints`). A cell goes through ``fleet.cells``
(:class:`.cells.Cells`) and :mod:`.execution` (supervised by :mod:`.watchdog`);
``fleet.elastic`` (:class:`.elastic.Elastic`) resizes and recovers, :mod:`.parking` parks.
:mod:`.magics`, :mod:`.panel` and :mod:`.labpanel` are the notebook's, the lab panel's and the
Jupyter server's way in.

Nothing under ``workbench.rank``, ``workbench.checkpoint``, ``workbench.metrics`` or
``workbench.parallel`` imports this package (tests/test_layers.py checks it).
"""
