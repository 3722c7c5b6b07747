"""Stragglers: ranks whose own compute is consistently slower than their peers'. Kernel side.

The rule (documented in the README): a step's *compute* is its step time minus the time its
collectives were in flight (``step_time_s − comm_s``). In synchronous training a slow rank
makes its peers wait inside their collectives, which counts as their communication time,
so the flag lands on the slow rank, not on the ones waiting. Over the last ``WINDOW`` steps
of each rank that carry a communication time (DDP steps under 20 ms carry one every few
steps), a rank is **slow** when the median of its compute is more than ``RATIO`` × the
median of the other ranks' medians, and more by at least ``MIN_EXTRA_S`` (a few
milliseconds of jitter on a tiny step is not a straggler). Every rank needs ``MIN_STEPS``
steps in the window first.
"""

from __future__ import annotations

import statistics

from workbench.kernel.metrics.store import Record

WINDOW = 20
MIN_STEPS = 10
RATIO = 1.3
MIN_EXTRA_S = 0.005


def _compute_times(records: list[Record]) -> list[float]:
    """Compute seconds of the last ``WINDOW`` step records (records without a step time are
    ``workbench.log`` calls between optimizer steps, or the first step of a cell; records without
    a communication time are DDP steps shorter than its reading interval: skipped)."""
    times = []
    for record in reversed(records):
        step, comm = record.system.get("step_time_s"), record.system.get("comm_s")
        if step is not None and comm is not None:
            times.append(max(0.0, step - comm))
            if len(times) == WINDOW:
                break
    return times


def slow_ranks(per_rank: dict[int, list[Record]]) -> dict[int, float]:
    """``{rank: its median compute ÷ the other ranks' median}`` for each slow rank."""
    medians = {}
    for rank, records in per_rank.items():
        times = _compute_times(records)
        if len(times) < MIN_STEPS:
            return {}
        medians[rank] = statistics.median(times)
    if len(medians) < 2:
        return {}
    slow = {}
    for rank, mine in medians.items():
        others = statistics.median(m for r, m in medians.items() if r != rank)
        if mine > RATIO * others and mine - others >= MIN_EXTRA_S:
            slow[rank] = mine / others if others > 0 else float("inf")
    return slow


def describe(rank: int, ratio: float) -> str:
    return (f"rank {rank} is slow: its compute per step (step time minus time in collectives) is {ratio:.1f}× "
            f"the other ranks' median over the last {WINDOW} steps")
