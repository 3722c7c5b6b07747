"""Soak: SIGKILL a rank in the middle of a checkpoint save, N times (default 20).

After every kill: ``latest`` must still be the previous complete checkpoint, no
half-written folder may be listed, the fleet must have replaced the dead rank,
and the next save (after setting up again) must work. Prints how many of N
iterations passed. ``python bench/soak_checkpoint_kills.py [N]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from common import report

from workbench import Fleet
from workbench.checkpoint import layout
from workbench.kernel.testing import kill_rank_during_save

SETUP = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
loss = model(torch.randn(8, 256)).pow(2).mean(); accelerator.backward(loss); optimizer.step()
"""


def main(n: int = 20) -> dict:
    passed, failures, started = 0, [], time.monotonic()
    gate = os.path.join(tempfile.mkdtemp(), "gate")
    with Fleet(n=2, progress=False, wandb=False) as fleet:
        fleet.run(SETUP, strategy="fsdp", show_output=False)
        good = fleet.checkpoints.save(tag="good-0")
        for i in range(n):
            try:
                error = kill_rank_during_save(fleet, victim=i % 2, gate=gate)
                assert error is not None, "the save did not fail"
                latest = layout.resolve(fleet.checkpoints.folder, "latest")
                assert latest.endswith("/" + good), f"latest is {latest}"
                assert not [e for e in fleet.checkpoints.list() if e.state == "writing"], "half-written listed"
                assert len(fleet.run("rank", show_output=False)) == 2
                fleet.run(SETUP, strategy="fsdp", show_output=False)
                fleet.checkpoints.restore("latest")
                good = fleet.checkpoints.save(tag=f"good-{i + 1}", keep_last=2)
                passed += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failures.append(f"iteration {i}: {type(exc).__name__}: {exc}"[:300])
            print(f"iteration {i + 1}/{n}: {passed} passed", flush=True)
    return report("soak_checkpoint_kills", {
        "iterations": n, "passed": passed, "failures": failures,
        "seconds": time.monotonic() - started,
    })


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
