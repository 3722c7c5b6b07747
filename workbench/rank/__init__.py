"""The rank side: what runs inside each engine process.

:mod:`.engine` is what the kernel calls on a rank (a cell, a function, attaching to a run);
:mod:`.rendezvous` joins and leaves the process group; :mod:`.strategies` and
:mod:`.instrument` prepare and measure what a cell's ``accelerator.prepare`` returns;
:mod:`.stacks` answers ``%fleet stacks``; :mod:`.template` is the warm process that engines fork from; :mod:`.batch_process`
runs a script's cells in a batch job. The ranks' public helpers stay where cells find them:
:mod:`workbench.checkpoint`, :mod:`workbench.metrics` (``workbench.log``),
:mod:`workbench.parallel`, :mod:`workbench.llm`, :mod:`workbench.trials` (``workbench.tune``). Below all of them:
:mod:`workbench.rank_state` (``STATE``, the rank's own state) and :mod:`workbench.data_position`.
"""
