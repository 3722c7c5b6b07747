"""Exactly-once data and exact resumes (issue 34): for each way a run is interrupted, the ids of a
96-sample epoch trained once / twice / never (newest attempt per step; the duplicates that fill
the last step of a pass, by accelerate's even_batches, counted apart), and the largest parameter
difference from the uninterrupted run at the same world size (0 = bit for bit).

The probe is the one of ``tests/test_exactly_once.py`` (map-style dataset, seeded shuffle, 4 per
rank, a loop on ``workbench.step``). What a torchrun + DCP + ``skip_first_batches`` workflow
gives on the same probe is in issue 34's table (e.g. a restart in epoch 1: 318 / 141 / 141).
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import test_exactly_once as probe  # noqa: E402
from common import report  # noqa: E402

from workbench import CellOptions, Fleet  # noqa: E402


def _counts(path: str, worlds: list[int]) -> str:
    """``once/twice/never`` ids per completed epoch, with the duplicates accelerate's padding adds."""
    epochs = probe.trained_per_epoch(path)
    parts = []
    for epoch, extra in sorted(probe.expected_padding(worlds).items()):
        counts = epochs[epoch]
        once = sum(1 for c in counts.values() if c == 1)
        parts.append(f"epoch {epoch}: {once}/{len(counts) - once}/{probe.N - len(counts)}"
                     + (f" (padding: {extra} expected twice)" if extra else ""))
    return "; ".join(parts)


def _diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _kill_and_recover(fleet, path, steps, kill_at, victims, options=None, **recover):
    pids = [fleet.member(r).pid for r in victims]
    try:
        probe.train(fleet, steps, 0, path, options, kill_at=kill_at, victims=victims)
    except Exception:  # the cell fails on the survivors when the victims die
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    probe.wait_until_gone(pids)
    return fleet.recover(**recover)


def _ddp_recovery(fleet, tmp, reference, steps: int, kill_at: int) -> dict:
    """Rank 1 SIGKILLed after step ``kill_at`` of a DDP run, %fleet recover, training on."""
    world = fleet.world_size
    path = str(tmp / f"recover{world}.jsonl")
    probe.fresh_start(fleet)
    _kill_and_recover(fleet, path, steps, kill_at, (1,))
    probe.train(fleet, steps, 1, path)
    return {f"DDP SIGKILL + recover, {world} ranks": _counts(path, [world] * steps),
            f"DDP recover {world} ranks: max |param - uninterrupted|": _diff(
                reference, fleet.run(probe.PARAMS, show_output=False)[0])}


def main() -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-exactly-once-"))
    result: dict = {}
    with Fleet(n=2, progress=False, wandb=False) as fleet:
        ref2 = probe.reference(fleet, tmp, 24)
        path = str(tmp / "restart.jsonl")
        probe.fresh_start(fleet)
        probe.train(fleet, 17, 0, path)
        fleet.run("workbench.checkpoint.save(tag='restart-17')", show_output=False)
        saved = fleet.checkpoints.list()[-1].path
        probe.fresh_start(fleet)  # the setup cells again: new model, optimizer and loader objects
        fleet.run(f"workbench.checkpoint.restore({saved!r})", show_output=False)
        probe.train(fleet, 24, 1, path)
        result["restart in epoch 1 (2 ranks): once/twice/never"] = _counts(path, [2] * 24)
        result["restart: max |param - uninterrupted|"] = _diff(ref2, fleet.run(probe.PARAMS, show_output=False)[0])

        path = str(tmp / "scale.jsonl")
        probe.fresh_start(fleet)
        probe.train(fleet, 5, 0, path)
        fleet.scale(3)
        probe.train(fleet, 13, 1, path)
        fleet.scale(2)
        probe.train(fleet, 24, 2, path)
        result["scale 2->3 at step 5, 3->2 at 13"] = _counts(path, [2] * 5 + [3] * 8 + [2] * 11)

        result.update(_ddp_recovery(fleet, tmp, ref2, 24, 13))

        fsdp = CellOptions(strategy="fsdp")
        path = str(tmp / "fsdp.jsonl")
        probe.fresh_start(fleet, fsdp)
        probe.train(fleet, 8, 0, path, fsdp)
        fleet.run("workbench.checkpoint.save(tag='fsdp-8')", strategy="fsdp", show_output=False)
        _kill_and_recover(fleet, path, 24, 11, (1,), fsdp)
        probe.train(fleet, 24, 2, path, fsdp)
        result["FSDP SIGKILL + recover from checkpoint, 2 ranks"] = _counts(path, [2] * 24)

        fleet.scale(3)
        result.update(_ddp_recovery(fleet, tmp, probe.reference(fleet, tmp, 16), 16, 9))

        fleet.scale(4)  # hsdp 2x2: ranks 1 and 2 killed, each shard still held by its replica (0 and 3)
        hsdp = CellOptions(strategy="hsdp", mesh="2x2")
        probe.reference(fleet, tmp, 12, hsdp)
        ref4 = fleet.run(probe.FULL_PARAMS, options=hsdp, show_output=False)[0]
        path = str(tmp / "hsdp.jsonl")
        probe.fresh_start(fleet, hsdp)
        recovered = _kill_and_recover(fleet, path, 12, 7, (1, 2), hsdp)
        probe.train(fleet, 12, 1, path, hsdp)
        result["hsdp 2x2 SIGKILL of ranks 1,2 + recover from live shards (sources)"] = \
            f"{_counts(path, [4] * 12)} (sources: ranks {recovered['sources']})"
        result["hsdp recover: max |param - uninterrupted|"] = _diff(
            ref4, fleet.run(probe.FULL_PARAMS, options=hsdp, show_output=False)[0])
        fleet.session.forget_setup()
    return report("exactly_once", result)


if __name__ == "__main__":
    main()
