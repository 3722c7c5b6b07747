"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import pathlib
import random
import statistics

RESULTS = pathlib.Path(__file__).parent / "results"


def median(xs):
    return statistics.median(xs)


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def median_interval(values, level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval (``level``) of the median of ``values``, e.g. the rounds' ratios: how far
    the median could move on another run of the same machine (seeded: the same values give the
    same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    cut = int((1 - level) / 2 * resamples)
    return medians[cut], medians[-cut - 1]


def verdict(values, target: float) -> str:
    """Whether the median of the rounds' ratios ``values`` meets ``target`` (at most), judged on its
    90 % interval: met, missed, or within the machine's noise (the interval holds the target)."""
    low, high = median_interval(values)
    interval = f"90 % interval {low:.3f}-{high:.3f} over {len(values)} rounds"
    if high <= target:
        return f"met ({interval})"
    if low > target:
        return f"missed ({interval})"
    return f"within noise ({interval} holds {target})"


def report(name: str, result: dict) -> dict:
    """Print one benchmark's numbers and keep them in bench/results/NAME.json."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(f"\n== {name}")
    for key, value in result.items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return result


def quiet_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env
