"""(c) A cell doing one all_reduce vs accelerate.notebook_launcher running the same function.

notebook_launcher forks 2 fresh processes per launch and keeps no state; the
fleet's ranks are already up. Target: fleet >= 10x faster.
"""

from __future__ import annotations

import time

from common import median, report

from workbench import Fleet

LAUNCHES, CELLS = 8, 50


def one_all_reduce():
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    Accelerator(cpu=True)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


def launcher_times() -> list[float]:
    from accelerate import notebook_launcher

    times = []
    for _ in range(LAUNCHES):
        start = time.perf_counter()
        notebook_launcher(one_all_reduce, num_processes=2)
        times.append(time.perf_counter() - start)
    return times


def fleet_times() -> list[float]:
    times = []
    with Fleet(n=2, progress=False) as fleet:
        fleet.run("import torch, torch.distributed as dist")
        for _ in range(CELLS):
            start = time.perf_counter()
            fleet.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2.0", show_output=False)
            times.append(time.perf_counter() - start)
    return times


def main() -> dict:
    theirs = launcher_times()  # before any fleet: notebook_launcher forks this process
    ours = fleet_times()
    return report("launch", {
        "fleet_cell_median_s": median(ours),
        "notebook_launcher_median_s": median(theirs),
        "speedup_fleet_vs_notebook_launcher": median(theirs) / median(ours),
        "target": ">= 15",
    })


if __name__ == "__main__":
    main()
