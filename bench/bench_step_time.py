"""(a) Step time of the same DDP loop: fleet.run on 2 ranks vs torchrun --nproc-per-node 2.

Rounds alternate between the two so that machine drift hits both; a ~45 ms step (width 1024)
and a ~10 ms one (width 384). Each step is timed on the wall clock and in rank 0's process CPU
time (its own threads only: steady on a busy machine, and it shows what workbench adds in the
rank; the wall clock also shows what the kernel and controller take from the cores). Targets:
<= 1.02 (45 ms), <= 1.03 (10 ms).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

from common import median, quiet_env, report, verdict

from workbench import Fleet

HERE = pathlib.Path(__file__).parent
STEPS, WARMUP, ROUNDS = 80, 10, 4
WIDTHS = (1024, 384)  # ~45 ms and ~10 ms steps on 2 CPU ranks


def torchrun_steps(width: int) -> tuple[list[float], list[float]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             str(HERE / "ddp_loop.py"), str(STEPS), out.name, str(width)],
            check=True, env=quiet_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wall, cpu = json.load(open(out.name))
        return wall[WARMUP:], cpu[WARMUP:]


def fleet_steps(fleet, width: int) -> tuple[list[float], list[float]]:
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ddp_loop import loop\n"
            f"loop(accelerator, {STEPS}, width={width}, cpu=True)")
    wall, cpu = fleet.run(code, show_output=False)[0]
    return wall[WARMUP:], cpu[WARMUP:]


def main() -> dict:
    times = {(who, width, clock): [] for who in ("fleet", "torchrun") for width in WIDTHS for clock in (0, 1)}
    rounds = {width: [] for width in WIDTHS}  # each round's fleet/torchrun ratio (wall)
    with Fleet(n=2, progress=False) as fleet:
        for _ in range(ROUNDS):
            for width in WIDTHS:
                measured = {"torchrun": torchrun_steps(width), "fleet": fleet_steps(fleet, width)}
                for who, clocks in measured.items():
                    for clock in (0, 1):
                        times[who, width, clock] += clocks[clock]
                rounds[width].append(median(measured["fleet"][0]) / median(measured["torchrun"][0]))

    def ratio(width: int, clock: int) -> float:
        return median(times["fleet", width, clock]) / median(times["torchrun", width, clock])

    return report("step_time", {
        "fleet_step_median_s": median(times["fleet", 1024, 0]),
        "torchrun_step_median_s": median(times["torchrun", 1024, 0]),
        "ratio_fleet_over_torchrun": ratio(1024, 0),
        "ratio_fleet_over_torchrun_cpu": ratio(1024, 1),
        "target": "<= 1.02",
        "verdict": verdict(rounds[1024], 1.02),
        "small_fleet_step_median_s": median(times["fleet", 384, 0]),
        "small_torchrun_step_median_s": median(times["torchrun", 384, 0]),
        "ratio_small_fleet_over_torchrun": ratio(384, 0),
        "ratio_small_fleet_over_torchrun_cpu": ratio(384, 1),
        "target_small": "<= 1.03",
        "verdict_small": verdict(rounds[384], 1.03),
        "steps_measured_each": len(times["fleet", 1024, 0]),
    })


if __name__ == "__main__":
    main()
