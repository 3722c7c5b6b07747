"""The quickstart and a rescale loop on a saturated machine (busy processes on every core):
no false engine death, no failed start or scale."""

from __future__ import annotations

import os
import pathlib

import nbformat
import pytest
from conftest import fleet_processes
from nbclient import NotebookClient

from workbench import Fleet
from workbench.kernel.testing import BusyMachine

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier

QUICKSTART = pathlib.Path(__file__).parent.parent / "notebooks" / "01_quickstart.ipynb"
BUSY = 3 * (os.cpu_count() or 1)  # load about 4 per core with the fleet's own processes


def test_quickstart_on_a_saturated_machine(tmp_path):
    before = {p.pid for p in fleet_processes()}
    nb = nbformat.read(QUICKSTART, as_version=4)
    with BusyMachine(BUSY):
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "DDP   loss" in text and "FSDP  loss" in text
    assert not [p for p in fleet_processes() if p.pid not in before and p.is_running()]


def test_scale_loop_on_a_saturated_machine():
    setup = ("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 8)\n"
             "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "model, optimizer = accelerator.prepare(model, optimizer)\n")
    from workbench import CellOptions

    with BusyMachine(BUSY), Fleet(n=2, progress=False, wandb=False) as fleet:
        fleet.execute(setup, CellOptions(strategy="fsdp"), show_output=False, setup=True)
        for _ in range(2):
            fleet.scale(3)
            assert fleet.run("world_size", strategy="fsdp", show_output=False) == [3, 3, 3]
            fleet.scale(2)
            assert fleet.run("world_size", strategy="fsdp", show_output=False) == [2, 2]
