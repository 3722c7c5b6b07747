"""(o) Checkpoints on object storage: save and restore through S3 vs the local disk.

2 CPU ranks, FSDP2, ~48 MB of model + AdamW state. The S3 server is moto's on 127.0.0.1
(no network; a real bucket adds its latency and bandwidth). Each round saves the same state
to a local folder and to ``s3://bench/...`` and restores each; the ratios are S3 time over
local time, kernel-side wall clock of ``fleet.checkpoints.save/restore``.
"""

from __future__ import annotations

import shutil
import tempfile
import time

from common import median, report

from workbench import Fleet
from workbench.kernel.testing import LocalS3

ROUNDS = 3
SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
loss = model(torch.randn(8, 1024)).pow(2).mean(); accelerator.backward(loss); optimizer.step()
sum(p.to_local().numel() * 4 * 3 for p in model.parameters()) / 2**20  # params + 2 Adam moments, MB
"""


def _timed(command) -> float:
    started = time.perf_counter()
    command()
    return time.perf_counter() - started


def main() -> dict:
    times: dict[str, list[float]] = {"local_save": [], "s3_save": [], "local_restore": [], "s3_restore": []}
    local = tempfile.mkdtemp(prefix="workbench-bench-ckpt-")
    with LocalS3("bench") as s3, Fleet(n=2, progress=False, wandb=False, tensorboard=False) as fleet:
        state_mb = sum(fleet.run(SETUP, strategy="fsdp", show_output=False))
        for i in range(ROUNDS):
            for where, folder in (("local", local), ("s3", s3.url("ckpt"))):
                times[f"{where}_save"].append(_timed(lambda i=i, folder=folder: fleet.checkpoints.save(tag=f"r{i}", to=folder)))
                times[f"{where}_restore"].append(_timed(lambda i=i, folder=folder: fleet.checkpoints.restore(f"{folder}/r{i}")))
    shutil.rmtree(local, ignore_errors=True)
    return report("object_storage", {
        "state_mb_total": state_mb,
        **{f"{key}_median_s": median(values) for key, values in times.items()},
        "ratio_s3_over_local_save": median(times["s3_save"]) / median(times["local_save"]),
        "ratio_s3_over_local_restore": median(times["s3_restore"]) / median(times["local_restore"]),
    })


if __name__ == "__main__":
    main()
