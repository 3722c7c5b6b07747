"""Nothing lost, whatever the user presses (issue 40): a recover on a healthy sharded fleet keeps
its live state, a background save commits before stop returns, and a dead rank's DataLoader
workers cannot hold the survivors in their collective."""

from __future__ import annotations

import os
import time

import pytest
from conftest import wait_until_gone

from workbench import CellOptions, DistributedCellError, Fleet, FleetError
from workbench.checkpoint import layout

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
for _ in range(3):
    accelerator.backward(model(torch.randn(8, 16)).pow(2).mean()); optimizer.step(); optimizer.zero_grad()
"""
FULL = "[(p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone() for p in model.parameters()]"


@pytest.fixture(scope="module")
def fleet():
    with Fleet(n=3, progress=False, wandb=False) as f:
        yield f


def test_recover_on_a_healthy_fsdp_fleet_keeps_the_live_state(fleet):
    """Was: 'no checkpoint yet: every rank starts again from the setup cells, at step 0'."""
    fsdp = CellOptions(strategy="fsdp")
    fleet.setup_cells = []
    fleet.execute(SETUP, fsdp, show_output=False, setup=True)
    fleet.run("workbench.step = 0", strategy="fsdp", show_output=False)
    fleet.run(TRAIN, strategy="fsdp", show_output=False)
    before = fleet.run(FULL, strategy="fsdp", show_output=False)[0]
    report = fleet.recover()
    assert report["step"] == 3 and report["checkpoint"] == f"recover-{fleet.generation - 1}", report
    after = fleet.run(FULL, strategy="fsdp", show_output=False)[0]
    assert all(a.equal(b) for a, b in zip(before, after, strict=True))


def test_a_dead_ranks_dataloader_workers_do_not_hold_the_survivors(fleet):
    """Was: the survivor was never released (the dead rank's forked workers kept its gloo sockets),
    was killed after ~10 s and recovery started at step 0."""
    fleet.setup_cells = []
    fleet.execute(SETUP + """
from torch.utils.data import DataLoader, TensorDataset
loader = accelerator.prepare(DataLoader(TensorDataset(torch.randn(4096, 16)), batch_size=8, num_workers=2))
""", CellOptions(), show_output=False, setup=True)
    fleet.run("workbench.step = 0", show_output=False)
    victim = fleet.member(1).pid
    survivors = [fleet.member(r).pid for r in (0, 2)]
    started = time.monotonic()
    with pytest.raises((DistributedCellError, FleetError)):
        fleet.run("""
import os, time
for (x,) in loader:
    accelerator.backward(model(x).pow(2).mean()); optimizer.step(); optimizer.zero_grad()
    if workbench.step == 6 and rank == 1:
        os.kill(os.getpid(), 9)
""", show_output=False)
    failed_after = time.monotonic() - started
    assert not wait_until_gone([victim])
    assert failed_after < 8, f"the cell failed only after {failed_after:.1f} s"
    assert [fleet.member(r).pid for r in (0, 2)] == survivors, "the survivors kept their engines"
    report = fleet.recover()
    assert report["source"] is not None and report["step"] == 6, report
    assert fleet.run("workbench.step", show_output=False) == [6, 6, 6]


def test_stop_waits_for_a_background_save_to_commit(tmp_path):
    """Was: an async save followed at once by %fleet stop left no checkpoint, not even a .tmp folder."""
    with Fleet(n=2, progress=False, wandb=False) as fleet:
        fleet.run(SETUP.replace("Linear(64, 4)", "Linear(64, 4), torch.nn.Linear(4, 4096), torch.nn.Linear(4096, 512)"),
                  show_output=False)
        fleet.checkpoints.save(tag="in-flight", async_=True)
        folder = fleet.checkpoints.folder
    manifest = layout.read_manifest(os.path.join(folder, "in-flight"))
    assert manifest.complete and manifest.world_size == 2


CHILD_OF_A_DYING_RANK = """
import os, sys, time
from workbench.rank import die_with_parent
parent = os.getpid()
child = os.fork()
if child == 0:
    die_with_parent(parent)
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
"""


def test_a_child_tied_with_die_with_parent_goes_when_its_rank_goes():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHILD_OF_A_DYING_RANK], capture_output=True, text=True, timeout=60)
    child = int(out.stdout.split()[0])
    assert not wait_until_gone([child], timeout=5), "the child outlived its parent"


def test_an_interrupt_leaves_the_engine_template_alive():
    """Was: every kernel interrupt also killed the engine template (it shared the kernel's process
    group), so later scale-ups and replacements started cold."""
    import re

    import psutil
    from conftest import Kernel

    kernel = Kernel()
    try:
        assert kernel.execute("%load_ext workbench\n%fleet start -n 2")[0]["status"] == "ok"
        kernel.execute("%%distributed\nimport time\ntime.sleep(30)", interrupt_after=3.0)
        _, messages = kernel.execute("from workbench.magics import current_fleet\n"
                                     "print('template', current_fleet().processes.template_pid)")
        pid = int(re.search(r"template (\d+)", kernel.text(messages)).group(1))
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        kernel.execute("%fleet stop")
    finally:
        kernel.shutdown()
