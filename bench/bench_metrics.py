"""(d) Live metrics: what logging costs the training loop, and how fast records reach the kernel.

One fleet, one run, rounds alternating between variants of the same DDP loop; a
ratio is the median over rounds of (variant median / same round's ``nolog`` median),
which cancels the drift of a shared machine:
- ``log``: ``workbench.log(loss=...)`` every step (target: ≤ 1% slower than ``nolog``);
- ``nolog``: no ``workbench.log`` call (workbench still records each optimizer step);
- ``plain``: prepared with accelerate's own ``prepare`` (no workbench measurements at all),
  to show what the built-in step/communication measurements cost;
- ``nolog_small`` / ``plain_small``: the same pair on a narrower MLP (a ~5 ms step), where
  a fixed per-step cost weighs more (target: ≤ 2 %; ≤ 1 % for the ~40 ms step).
Latency: for every record of the ``log`` rounds, kernel arrival time minus the time
``workbench.log`` was called on the rank (same machine, same clock): p50 / p95,
target p95 ≤ 500 ms.
"""

from __future__ import annotations

import pathlib

from common import median, p95, report

from workbench import Fleet

HERE = pathlib.Path(__file__).parent
STEPS, WARMUP, ROUNDS = 60, 10, 10
SMALL_WIDTH, SMALL_STEPS = 384, 400  # about 5 ms a step on 2 CPU ranks; more steps for as long a round


def steps(fleet, count: int = STEPS, **flags) -> list[float]:
    args = ", ".join(f"{k}={v!r}" for k, v in flags.items())
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ddp_loop import loop\n"
            f"loop(accelerator, {count}, {args})")
    return fleet.run(code, show_output=False)[0][WARMUP:]


def main() -> dict:
    times = {"log": [], "nolog": [], "plain": [], "nolog_small": [], "plain_small": []}
    paired = {"log": [], "plain": [], "plain_small": []}  # each round's median over the same round's nolog median
    latencies = []
    with Fleet(n=2, progress=False) as fleet:
        for _ in range(ROUNDS):
            rounds = {}
            for variant in times:
                start = len(fleet.metrics.store)
                flags = {"log": variant == "log", "plain": variant.startswith("plain")}
                if variant.endswith("_small"):
                    flags.update(width=SMALL_WIDTH, count=SMALL_STEPS)
                rounds[variant] = steps(fleet, **flags)
                times[variant] += rounds[variant]
                if variant == "log":
                    records = [r for r in fleet.metrics.store.since(start) if "loss" in r.scalars]
                    assert len(records) == 2 * STEPS, len(records)
                    latencies += [r.arrived - r.time for r in records]
            paired["log"].append(median(rounds["log"]) / median(rounds["nolog"]))
            paired["plain"].append(median(rounds["nolog"]) / median(rounds["plain"]))
            paired["plain_small"].append(median(rounds["nolog_small"]) / median(rounds["plain_small"]))
    log, nolog, plain = (median(times[v]) for v in ("log", "nolog", "plain"))
    return report("metrics", {
        "step_median_log_s": log,
        "step_median_nolog_s": nolog,
        "step_median_plain_accelerate_s": plain,
        "ratio_log_over_nolog": median(paired["log"]),
        "target_log_over_nolog": "<= 1.01",
        "ratio_log_over_nolog_rounds": [round(r, 3) for r in paired["log"]],
        "ratio_nolog_over_plain": median(paired["plain"]),
        "ratio_nolog_over_plain_rounds": [round(r, 3) for r in paired["plain"]],
        "target_nolog_over_plain": "<= 1.01",
        "small_step_median_nolog_s": median(times["nolog_small"]),
        "small_step_median_plain_s": median(times["plain_small"]),
        "ratio_small_nolog_over_plain": median(paired["plain_small"]),
        "ratio_small_nolog_over_plain_rounds": [round(r, 3) for r in paired["plain_small"]],
        "target_small_nolog_over_plain": "<= 1.02",
        "latency_p50_ms": median(latencies) * 1e3,
        "latency_p95_ms": p95(latencies) * 1e3,
        "target_latency_p95_ms": "<= 500",
        "records_timed": len(latencies),
    })


if __name__ == "__main__":
    main()
