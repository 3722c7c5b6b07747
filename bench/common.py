"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import pathlib
import statistics

RESULTS = pathlib.Path(__file__).parent / "results"


def median(xs):
    return statistics.median(xs)


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


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
