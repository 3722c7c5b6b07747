"""(a) Step time of the same DDP loop: fleet.run on 2 ranks vs torchrun --nproc-per-node 2.

Rounds alternate between the two so that machine drift hits both. Target ratio <= 1.02.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

from common import median, quiet_env, report

from workbench import Fleet

HERE = pathlib.Path(__file__).parent
STEPS, WARMUP, ROUNDS = 80, 10, 4


def torchrun_steps() -> list[float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             str(HERE / "ddp_loop.py"), str(STEPS), out.name],
            check=True, env=quiet_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        return json.load(open(out.name))[WARMUP:]


def fleet_steps(fleet) -> list[float]:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ddp_loop import loop\nloop(accelerator, {STEPS})"
    return fleet.run(code, show_output=False)[0][WARMUP:]


def main() -> dict:
    ours, theirs = [], []
    with Fleet(n=2, progress=False) as fleet:
        for _ in range(ROUNDS):
            theirs += torchrun_steps()
            ours += fleet_steps(fleet)
    return report("step_time", {
        "fleet_step_median_s": median(ours),
        "torchrun_step_median_s": median(theirs),
        "ratio_fleet_over_torchrun": median(ours) / median(theirs),
        "target": "<= 1.02",
        "steps_measured_each": len(ours),
    })


if __name__ == "__main__":
    main()
