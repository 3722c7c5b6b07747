"""The README's quickstart, a rescale loop and the "nothing lost" cases on a saturated machine,
repeated: how many pass.

``python bench/soak_under_load.py [QUICKSTARTS] [SCALES] [BUSY] [INTERRUPTS] [STOPS]`` (default 10,
20, 12, 20, 3): BUSY processes spin on the CPUs (load about 7 per core on 2 cores) while the
quickstart notebook runs headless QUICKSTARTS times, a 2-rank fleet scales 2→3→2 SCALES times,
a 3-rank fleet's scale or recover is interrupted INTERRUPTS times at a random moment (then
``%fleet recover``: the weights and ``workbench.step`` must be those before), and STOPS times an
async save is followed at once by ``stop()`` (the checkpoint must be complete). Every run is
expected to pass; a failure prints its first line.
"""

from __future__ import annotations

import os
import pathlib
import random
import sys
import tempfile
import time

import nbformat
from common import report
from nbclient import NotebookClient

from workbench import CellOptions, Fleet
from workbench.checkpoint import layout
from workbench.kernel.testing import BusyMachine, interrupted_after

QUICKSTART = pathlib.Path(__file__).parent.parent / "notebooks" / "01_quickstart.ipynb"
SETUP = ("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 8)\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "model, optimizer = accelerator.prepare(model, optimizer)\n")


def quickstart() -> None:
    nb = nbformat.read(QUICKSTART, as_version=4)
    with tempfile.TemporaryDirectory() as folder:
        NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": folder}}).execute()


WEIGHTS = "[(p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone() for p in model.parameters()]"


def interrupts(fleet, count: int, rng: random.Random) -> tuple[int, int]:
    """Interrupt scale or recover ``count`` times at random; returns (state kept, interrupts landed)."""
    fleet.run("workbench.step = 3", show_output=False)
    before = fleet.run(WEIGHTS, strategy="fsdp", show_output=False)[0]
    kept = landed = 0
    for attempt in range(count):
        target = 2 if fleet.world_size == 3 else 3
        command = (lambda target=target: fleet.scale(target)) if attempt % 3 else fleet.recover
        if interrupted_after(command, rng.uniform(0.0, 1.5)):
            landed += 1
            fleet.recover()
        same = all(all(a.equal(b) for a, b in zip(before, got, strict=True))
                   for got in fleet.run(WEIGHTS, strategy="fsdp", show_output=False))
        kept += same and fleet.run("workbench.step", show_output=False) == [3] * fleet.world_size
    return kept, landed


def save_then_stop() -> bool:
    """``%checkpoint save --async`` then ``%fleet stop`` at once: the checkpoint is complete."""
    fleet = Fleet(n=2, progress=False, wandb=False).start()
    try:
        fleet.execute(SETUP, CellOptions(strategy="fsdp"), show_output=False)
        fleet.checkpoints.save(tag="before-stop", async_=True)
    finally:
        fleet.stop()
    return os.path.isfile(os.path.join(fleet.checkpoints.folder, "before-stop", layout.MANIFEST))


def main(quickstarts: int = 10, scales: int = 20, busy: int = 12, interrupt_count: int = 20, stops: int = 3) -> dict:
    failures: list[str] = []
    passed = {"quickstart": 0, "scale": 0, "stop": 0}
    kept = landed = 0
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
            if interrupt_count:
                fleet.scale(3)
                try:
                    kept, landed = interrupts(fleet, interrupt_count, random.Random(40))
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"interrupts: {str(exc).strip().splitlines()[0][:200]}")
        for i in range(stops):
            try:
                passed["stop"] += save_then_stop()
            except Exception as exc:  # noqa: BLE001
                failures.append(f"save then stop {i}: {str(exc).strip().splitlines()[0][:200]}")
    for line in failures:
        print("FAILED", line)
    return report("soak_under_load", {
        "busy_processes": busy,
        "quickstart_passed": f"{passed['quickstart']}/{quickstarts}",
        "scale_2_3_2_passed": f"{passed['scale']}/{scales}",
        "interrupted_scale_or_recover_state_kept": f"{kept}/{interrupt_count} ({landed} interrupts landed)",
        "async_save_then_stop_complete": f"{passed['stop']}/{stops}",
        "quickstart_median_s": sorted(seconds["quickstart"])[len(seconds["quickstart"]) // 2] if quickstarts else 0.0,
        "scale_cycle_median_s": sorted(seconds["scale"])[len(seconds["scale"]) // 2] if scales else 0.0,
    })


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:6]))
