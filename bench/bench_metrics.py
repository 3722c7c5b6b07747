"""(d) Live metrics: what logging and the built-in measurements cost, and how fast records arrive.

One fleet, one run, rounds alternating between variants of the same DDP loop; a
ratio is the median over rounds of (variant median / same round's baseline median),
which cancels the drift of a shared machine. Each step is timed on the wall clock and
in the rank's process CPU time (all its threads, no other process: steady on a busy box).
- ``log`` vs ``nolog``: ``workbench.log(loss=...)`` every step of a ~40 ms step (≤ 1 %);
- ``nolog`` vs ``plain`` (prepared with accelerate's own ``prepare``: no workbench
  measurements at all): what the built-in per-step instrumentation and the ranks'
  background threads cost, on the ~40 ms step and the ~8 ms ``small`` one (≤ 2 %);
- ``log_tiny`` vs ``nolog_tiny``: logging every step of the smallest DDP step (≤ 5 %; ~2.5 ms
  here, gloo's all-reduce latency on 2 busy cores).
Per record: ``workbench.log``'s CPU time on the rank's thread (≤ 5 µs; its wall time too, which
on a busy machine includes waits for the core) and the CPU a record
costs end to end, rank (call, encoding, sending) + kernel (receiving, store, metrics.jsonl,
wandb, TensorBoard) over a baseline cell of the same length without records (≤ 20 µs).
Latency: for every record of the ``log`` rounds, kernel arrival time minus the time
``workbench.log`` was called on the rank (same machine, same clock): p50 / p95, ≤ 500 ms.
"""

from __future__ import annotations

import pathlib
import resource

import psutil
from common import median, p95, report, verdict

from workbench import Fleet

HERE = pathlib.Path(__file__).parent
STEPS, WARMUP, ROUNDS = 60, 10, 10
SMALL_WIDTH, SMALL_STEPS = 384, 400  # about 8 ms a step on 2 CPU ranks; more steps for as long a round
TINY_WIDTH, TINY_STEPS = 32, 1500  # about 2.5 ms a step: as small as DDP on gloo gets here
RECORDS = 20_000  # per rank, for the per-record costs
VARIANTS = {  # name: loop flags
    "log": {"log": True}, "nolog": {}, "plain": {"plain": True},
    "nolog_small": {"width": SMALL_WIDTH, "count": SMALL_STEPS},
    "plain_small": {"width": SMALL_WIDTH, "count": SMALL_STEPS, "plain": True},
    "log_tiny": {"width": TINY_WIDTH, "count": TINY_STEPS, "log": True},
    "nolog_tiny": {"width": TINY_WIDTH, "count": TINY_STEPS},
}
PAIRS = {  # ratio name: (variant, baseline)
    "log_over_nolog": ("log", "nolog"),
    "nolog_over_plain": ("nolog", "plain"),
    "small_nolog_over_plain": ("nolog_small", "plain_small"),
    "tiny_log_over_nolog": ("log_tiny", "nolog_tiny"),
}
TARGETS = {"log_over_nolog": 1.01, "nolog_over_plain": 1.02, "small_nolog_over_plain": 1.02,
           "tiny_log_over_nolog": 1.05}


def steps(fleet, count: int = STEPS, **flags) -> tuple[list[float], list[float]]:
    """Rank 0's (wall, cpu) seconds of each step after the warm-up."""
    args = ", ".join(f"{k}={v!r}" for k, v in flags.items())
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ddp_loop import loop\n"
            f"loop(accelerator, {count}, cpu=True, {args})")
    wall, cpu = fleet.run(code, show_output=False)[0]
    return wall[WARMUP:], cpu[WARMUP:]


FLEET_PROCESSES = ("ipyparallel.controller", "workbench.rank")  # not the sinks' processes


def _kernel_cpu() -> float:
    """CPU seconds of the kernel and of the processes its sinks started (wandb's service and its
    system monitor), not of the fleet's controller and engines."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            if not any(name in " ".join(child.cmdline()) for name in FLEET_PROCESSES):
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # gone meanwhile
            continue
    return total


RECORD_CELL = """
import time, workbench
from workbench.metrics.logger import LOGGER
LOGGER.flush(5.0)
cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
for i in range({n}):
    workbench.log(loss=0.5)
time.sleep({sleep})
thread, wall = time.thread_time() - thread0, time.perf_counter() - wall0
LOGGER.flush(10.0)
time.sleep(0.5)
wall, thread, time.process_time() - cpu0
"""


def record_costs(fleet) -> dict:
    """``workbench.log`` on the rank's thread, and the CPU of a record end to end (ranks +
    kernel), over a baseline cell that runs as long without logging."""
    def cell(n: int, sleep: float = 0.0):
        kernel = _kernel_cpu()
        replies = fleet.run(RECORD_CELL.format(n=n, sleep=sleep), show_output=False)
        return replies, _kernel_cpu() - kernel

    cell(RECORDS // 10)  # warm
    logged, kernel_logged = cell(RECORDS)
    # the baseline sleeps as long as the logging loop took, logging nothing
    baseline, kernel_baseline = cell(0, sleep=median([r[0] for r in logged]))
    records = RECORDS * len(logged)
    rank_cpu = sum(r[2] for r in logged) - sum(r[2] for r in baseline)
    kernel_cpu = kernel_logged - kernel_baseline
    return {
        "record_rank_thread_cpu_us": median([r[1] for r in logged]) / RECORDS * 1e6,
        "record_rank_thread_wall_us": median([r[0] for r in logged]) / RECORDS * 1e6,
        "target_record_rank_thread_cpu_us": "<= 5",
        "record_cpu_rank_us": rank_cpu / records * 1e6,
        "record_cpu_kernel_us": kernel_cpu / records * 1e6,
        "record_cpu_end_to_end_us": (rank_cpu + kernel_cpu) / records * 1e6,
        "target_record_cpu_end_to_end_us": "<= 20",
    }


def main() -> dict:
    wall = {v: [] for v in VARIANTS}
    paired = {name: {"wall": [], "cpu": []} for name in PAIRS}
    latencies = []
    with Fleet(n=2, progress=False) as fleet:
        costs = record_costs(fleet)
        for _ in range(ROUNDS):
            rounds = {}
            for variant, flags in VARIANTS.items():
                start = len(fleet.metrics.store)
                rounds[variant] = steps(fleet, **flags)
                wall[variant] += rounds[variant][0]
                if variant == "log":
                    records = [r for r in fleet.metrics.store.since(start) if "loss" in r.scalars]
                    assert len(records) == 2 * STEPS, len(records)
                    latencies += [r.arrived - r.time for r in records]
            for name, (variant, baseline) in PAIRS.items():
                for i, clock in enumerate(("wall", "cpu")):
                    paired[name][clock].append(median(rounds[variant][i]) / median(rounds[baseline][i]))
    result = {
        "step_median_log_s": median(wall["log"]),
        "step_median_nolog_s": median(wall["nolog"]),
        "step_median_plain_accelerate_s": median(wall["plain"]),
        "small_step_median_nolog_s": median(wall["nolog_small"]),
        "tiny_step_median_nolog_s": median(wall["nolog_tiny"]),
    }
    for name, clocks in paired.items():
        result[f"ratio_{name}"] = median(clocks["wall"])
        result[f"ratio_{name}_cpu"] = median(clocks["cpu"])
        result[f"target_{name}"] = f"<= {TARGETS[name]}"
        result[f"ratio_{name}_rounds"] = [round(r, 3) for r in clocks["wall"]]
        result[f"verdict_{name}"] = verdict(clocks["wall"], TARGETS[name])
        result[f"verdict_{name}_cpu"] = verdict(clocks["cpu"], TARGETS[name])
    result.update(costs)
    result.update({
        "latency_p50_ms": median(latencies) * 1e3,
        "latency_p95_ms": p95(latencies) * 1e3,
        "target_latency_p95_ms": "<= 500",
        "records_timed": len(latencies),
    })
    return report("metrics", result)


if __name__ == "__main__":
    main()
