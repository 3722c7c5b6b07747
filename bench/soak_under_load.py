"""The README's quickstart and a rescale loop on a saturated machine, repeated: how many pass.

``python bench/soak_under_load.py [QUICKSTARTS] [SCALES] [BUSY]`` (default 10, 20, 12): BUSY
processes spin on the CPUs (load about 7 per core on 2 cores) while the quickstart notebook
runs headless QUICKSTARTS times and a 2-rank fleet scales 2→3→2 SCALES times. Every run is
expected to pass; a failure prints its first line.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

import nbformat
from common import report
from nbclient import NotebookClient

from workbench import CellOptions, Fleet
from workbench.testing import BusyMachine

QUICKSTART = pathlib.Path(__file__).parent.parent / "notebooks" / "01_quickstart.ipynb"
SETUP = ("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 8)\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "model, optimizer = accelerator.prepare(model, optimizer)\n")


def quickstart() -> None:
    nb = nbformat.read(QUICKSTART, as_version=4)
    with tempfile.TemporaryDirectory() as folder:
        NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": folder}}).execute()


def main(quickstarts: int = 10, scales: int = 20, busy: int = 12) -> dict:
    failures: list[str] = []
    passed = {"quickstart": 0, "scale": 0}
    seconds = {"quickstart": [], "scale": []}
    with BusyMachine(busy):
        for i in range(quickstarts):
            started = time.monotonic()
            try:
                quickstart()
                passed["quickstart"] += 1
            except Exception as exc:  # noqa: BLE001 - counted and shown
                failures.append(f"quickstart {i}: {str(exc).strip().splitlines()[0][:200]}")
            seconds["quickstart"].append(time.monotonic() - started)
            print(f"quickstart {i + 1}/{quickstarts}: {seconds['quickstart'][-1]:.0f} s", flush=True)
        with Fleet(n=2, progress=False, wandb=False) as fleet:
            fleet.execute(SETUP, CellOptions(strategy="fsdp"), show_output=False, setup=True)
            for i in range(scales):
                started = time.monotonic()
                try:
                    for n in (3, 2):
                        fleet.scale(n)
                        assert fleet.run("world_size", strategy="fsdp", show_output=False) == [n] * n
                    passed["scale"] += 1
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"scale {i}: {str(exc).strip().splitlines()[0][:200]}")
                seconds["scale"].append(time.monotonic() - started)
    for line in failures:
        print("FAILED", line)
    return report("soak_under_load", {
        "busy_processes": busy,
        "quickstart_passed": f"{passed['quickstart']}/{quickstarts}",
        "scale_2_3_2_passed": f"{passed['scale']}/{scales}",
        "quickstart_median_s": sorted(seconds["quickstart"])[len(seconds["quickstart"]) // 2] if quickstarts else 0.0,
        "scale_cycle_median_s": sorted(seconds["scale"])[len(seconds["scale"]) // 2] if scales else 0.0,
    })


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
