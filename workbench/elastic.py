"""Rescaling a running fleet: ``fleet.scale(N)`` / ``%fleet scale N``.

The phases (shown with their timings while they run): checkpoint the prepared
state, tear the process group down, add or remove engines (one GPU each on a
GPU box), rendezvous at the new size on a fresh port, replay the recorded
``%%distributed --setup`` cells on every rank, and restore the checkpoint,
resharded. Re-running the training cell then goes on from ``workbench.step``.
"""

from __future__ import annotations

import time

from . import rendezvous
from .devices import EngineSlot, visible_gpus
from .errors import OptionsError
from .output import ProgressLine


def new_slots(fleet, count: int) -> list[EngineSlot]:
    """Slots for ``count`` more engines: the next slot numbers, and GPUs not in use."""
    used = [m.slot for m in fleet.members]
    first = max(s.slot for s in used) + 1 if used else 0
    if fleet.device_type == "cpu":
        return [EngineSlot(first + i) for i in range(count)]
    busy = {s.gpu for s in used}
    free = [g for g in visible_gpus() if g not in busy]
    if len(free) < count:
        raise OptionsError(
            f"scaling needs {count} more GPUs but only {len(free)} visible GPU(s) are free "
            f"({', '.join(free) or 'none'}); one engine per GPU"
        )
    return [EngineSlot(first + i, free[i]) for i in range(count)]


def scale(fleet, n: int) -> dict:
    """Resize ``fleet`` to ``n`` ranks, keeping training state; returns the phases' seconds."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise OptionsError(f"scale needs a whole number of ranks >= 1 (got {n!r}); e.g. %fleet scale 3")
    fleet._targets(None)
    old = fleet.world_size
    if n == old:
        raise OptionsError(f"the fleet already has {n} ranks")
    progress = ProgressLine(fleet.progress)
    timings: dict[str, float] = {}

    def phase(name: str, text: str):
        progress.show(f"scale {old}→{n}: {text}…  " + "  ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
        return name, time.monotonic()

    name, t = phase("checkpoint", "checkpoint")
    tag = fleet.checkpoints.save(tag=f"rescale-{fleet.generation}-{old}to{n}")
    timings[name] = time.monotonic() - t

    name, t = phase("teardown", "process group teardown")
    fleet.client[fleet.engine_ids()].apply_sync(rendezvous.leave)
    timings[name] = time.monotonic() - t

    name, t = phase("engines", "adding engines" if n > old else "removing engines")
    if n > old:
        fleet._add_engines(new_slots(fleet, n - old))
    else:
        fleet._remove_ranks(list(range(n, old)))
    timings[name] = time.monotonic() - t

    name, t = phase("rendezvous", "rendezvous")
    fleet.rendezvous()
    timings[name] = time.monotonic() - t

    name, t = phase("setup", f"replaying {len(fleet.setup_cells)} setup cell(s)")
    for code, options in fleet.setup_cells:
        fleet.execute(code, options, show_output=False)
    timings[name] = time.monotonic() - t

    name, t = phase("restore", "restoring (resharded)")
    report = fleet.checkpoints.restore(tag)
    timings[name] = time.monotonic() - t
    total = sum(timings.values())
    progress.show(f"scale {old}→{n}: done in {total:.1f} s (" + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())
                  + f"); restored {', '.join(report['restored']) or 'nothing'} at step {report['step']}")
    return {"timings": timings, "checkpoint": tag, "restored": report["restored"], "step": report["step"]}
