"""A notebook's cells as a batch job: the runtime of a script written by ``%fleet export``.

Under ``torchrun``, ``accelerate launch`` or plain ``python`` (one process),
:func:`start` joins the process group those launchers describe in the
environment, and :meth:`ScriptRun.cell` gives each exported cell the names a
``%%distributed`` cell has (``accelerator`` built from the cell's flags,
``rank``, ``world_size``, ``local_rank``, ``device``, ``mesh``, ``workbench``).
Records from ``workbench.log`` go to ``./workbench-runs/<run-id>/metrics.jsonl``
(and wandb / TensorBoard, as in a fleet run) through a collector in rank 0;
``workbench.save`` / ``restore`` use that run's ``checkpoints/``. On several
nodes, only the ranks on rank 0's node send metrics (the collector listens on a
local socket); training is not affected.
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

from workbench.metrics.logger import LOGGER
from workbench.options import CellOptions
from workbench.rank import engine, rendezvous

SCRIPT_PG_TIMEOUT_S = 1800.0


class ScriptRun:
    """This process's part of an exported script's run."""

    def __init__(self, run_id: str, run_dir: str, metrics=None, runtime_dir: str | None = None) -> None:
        self.run_id, self.run_dir = run_id, run_dir
        self.metrics = metrics  # rank 0: FleetMetrics, the collector and sinks of the run
        self.runtime_dir = runtime_dir
        self._in_cell = False

    def cell(self, **options) -> dict:
        """The names of a ``%%distributed`` cell with these flags (a :class:`CellOptions`'s fields)."""
        self._end_cell()
        names = engine.names(CellOptions(**options))
        engine.STATE.cells += 1
        LOGGER.cell_started()
        self._in_cell = True
        return names

    def _end_cell(self) -> None:
        if self._in_cell:
            from workbench.checkpoint.api import wait_for_staging

            wait_for_staging()
            LOGGER.cell_finished()
            self._in_cell = False

    def finish(self) -> None:
        """End of the script: background checkpoint saves finish, every rank's records reach
        metrics.jsonl, rank 0 prints the run's summary, and the process group is left."""
        import torch.distributed as dist

        from workbench.checkpoint.api import wait

        self._end_cell()
        wait()
        sent = {engine.STATE.spec.rank: (os.getpid(), LOGGER.flush())}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sent)
        if self.metrics is not None:
            expected = {rank: ps for each in everyone for rank, ps in each.items() if ps[1]}
            self.metrics.store.wait_for(expected, 10.0)
            self.metrics.collector.flush()
            print(self.metrics.summary(), flush=True)
            print(f"workbench: the run's files are in {self.run_dir}", flush=True)
            self.metrics.close()
            if self.runtime_dir:
                import shutil

                shutil.rmtree(self.runtime_dir, ignore_errors=True)
        dist.barrier()
        dist.destroy_process_group()
        engine.STATE.left()


def start(runs_dir: str | None = None) -> ScriptRun:
    """Join the process group of the launcher that started this process (``torchrun``,
    ``accelerate launch``; one process when there is none) and open the run folder."""
    import torch
    import torch.distributed as dist

    _single_process_environment()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    rendezvous._accelerate_launch_environment(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=SCRIPT_PG_TIMEOUT_S))
    spec = rendezvous.RendezvousSpec(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]), backend=backend,
        timeout_s=SCRIPT_PG_TIMEOUT_S, generation=0, node_rank=int(os.environ.get("GROUP_RANK", 0)),
        nodes=max(1, world // max(1, local_world)),
    )
    engine.STATE.joined(spec, device, set(), dist.distributed_c10d._get_default_group())
    run = _open_run(runs_dir, spec)
    engine.STATE.run_dir = run.run_dir
    return run


def _single_process_environment() -> None:
    """``python train.py``: a process group of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=rendezvous.LOOPBACK, MASTER_PORT=str(rendezvous.free_port()))


def _open_run(runs_dir: str | None, spec) -> ScriptRun:
    """Rank 0 makes the run folder and the metrics collector; every rank on its node sends there."""
    import torch.distributed as dist

    shared: list = [None]
    run = None
    if spec.rank == 0:
        from workbench.kernel.metrics.live import FleetMetrics
        from workbench.kernel.runs import new_run_dir

        run_id, run_dir = new_run_dir(runs_dir)
        runtime_dir = tempfile.mkdtemp(prefix="workbench-script-")
        metrics = FleetMetrics(run_id, run_dir, runtime_dir, lambda: spec.world_size,
                               {"ranks": spec.world_size, "backend": spec.backend, "script": sys.argv[0]})
        run = ScriptRun(run_id, run_dir, metrics, runtime_dir)
        shared = [(run_id, run_dir, metrics.address, metrics.collector.key)]
    dist.broadcast_object_list(shared, src=0)
    run_id, run_dir, address, key = shared[0]
    if spec.node_rank == 0:
        LOGGER.attach(address, key)
    return run or ScriptRun(run_id, run_dir)
