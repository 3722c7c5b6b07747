"""Plain-text summary of a cell's metrics: what headless runs (nbconvert) show."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from workbench.kernel.metrics.store import Record


def per_rank(records: list[Record]) -> dict[int, list[Record]]:
    ranks: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        ranks[record.rank].append(record)
    return dict(sorted(ranks.items()))


def steps_per_second(records: list[Record]) -> float | None:
    """Steps per second of one rank's records: steps ÷ the time the steps took (the sum of their
    step times, so the idle time between cells does not count); the wall time they span when
    step times are missing."""
    if not records:
        return None
    times = [r.system.get("step_time_s") for r in records]
    if all(t is not None for t in times):
        busy = sum(times)
    else:
        busy = records[-1].time - records[0].time + (times[0] or 0.0)
    return len(records) / busy if busy > 0 else None


def non_finite(records: list[Record]) -> list[str]:
    """One line per scalar that went NaN or infinite: where it first did, and how often."""
    first: dict[str, Record] = {}
    count: dict[str, int] = defaultdict(int)
    for record in records:
        for name, value in record.scalars.items():
            if isinstance(value, float) and not math.isfinite(value):
                first.setdefault(name, record)
                count[name] += 1
    return [f"{name} is {record.scalars[name]} at step {record.step} on rank {record.rank}"
            + (f" ({count[name]} non-finite values in this cell)" if count[name] > 1 else "")
            for name, record in first.items()]


def rate(records: list[Record], key: str, scale: float = 1.0) -> float | None:
    """A per-step rate (``samples_per_s``, ``tokens_per_s``, ``mfu``) over ``records``: what the
    steps did ÷ the time they took, i.e. each step's rate weighted by its step time (a plain mean
    of rates lets a few very short steps dominate)."""
    timed = [(r.system[key], r.system["step_time_s"]) for r in records
             if key in r.system and r.system.get("step_time_s")]
    took = sum(t for _, t in timed)
    return sum(v * t for v, t in timed) / took * scale if took > 0 else None


def mean_of(records: list[Record], key: str, scale: float = 1.0) -> float | None:
    values = [r.system[key] for r in records if key in r.system]
    return statistics.fmean(values) * scale if values else None


def peak_of(records: list[Record], key: str) -> float | None:
    return max((r.system[key] for r in records if key in r.system), default=None)


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e6):
        return str(int(value))
    return f"{value:.4g}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header, *[[_number(c) if not isinstance(c, str) else c for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def summary_text(records: list[Record], run_id: str, dropped: int = 0) -> str:
    """Last / min / mean of each scalar per rank, then steps/s, step, comm and memory per rank."""
    if not records:
        return f"metrics · run {run_id}: nothing was logged"
    ranks = per_rank(records)
    steps = [r.step for r in records]
    lines = [f"metrics · run {run_id} · steps {min(steps)}–{max(steps)} on {len(ranks)} ranks"
             + (f" · {dropped} records dropped" if dropped else "")]
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record.scalars))
    for count in ("samples", "tokens"):  # per-step counts: shown as throughput below, not as scalars
        if any(count + "_per_s" in r.system for r in records):
            names.pop(count, None)
    rows = []
    for name in names:
        for rank, recs in ranks.items():
            values = [r.scalars[name] for r in recs if name in r.scalars]
            if values:
                rows.append([name, str(rank), values[-1], min(values), statistics.fmean(values)])
    if rows:
        lines += _table(["scalar", "rank", "last", "min", "mean"], rows)
    llm = any("tokens_per_s" in r.system for r in records)  # language models: tokens/s and MFU too
    gpu = any("gpu_util_pct" in r.system for r in records)  # NVML: utilisation and device memory
    system_rows, fleet = [], {"samples_per_s": 0.0, "tokens_per_s": 0.0}
    for rank, recs in ranks.items():
        steady = recs[1:] or recs  # the first step (compilation, allocation, warm-up) is shown apart
        rates = {key: rate(steady, key) for key in fleet}
        for key, value in rates.items():
            fleet[key] += value or 0.0
        system_rows.append([
            str(rank), len(recs), steps_per_second(steady), mean_of(steady, "step_time_s", 1e3),
            recs[0].system.get("step_time_s", 0.0) * 1e3, mean_of(steady, "comm_s", 1e3),
            rates["samples_per_s"], peak_of(recs, "rss_mb"),
        ] + ([rates["tokens_per_s"], rate(steady, "mfu", 100.0)] if llm else [])
          + ([mean_of(steady, "gpu_util_pct"), peak_of(recs, "gpu_mem_used_mb")] if gpu else []))
    if len(ranks) > 1:
        system_rows.append(["all", len(records), None, None, None, None, fleet["samples_per_s"] or None, None]
                           + ([fleet["tokens_per_s"] or None, None] if llm else []) + ([None, None] if gpu else []))
    lines += _table(["rank", "records", "steps/s", "step ms", "first step ms", "comm ms", "samples/s", "peak rss MiB"]
                    + (["tokens/s", "MFU %"] if llm else []) + (["GPU util %", "GPU mem MiB"] if gpu else []),
                    system_rows)
    return "\n".join(lines)
