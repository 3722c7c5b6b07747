"""(e) Checkpoints on 2 CPU ranks, FSDP2, ~200 MB of model + AdamW state (~100 MB a rank).

- blocked: how long the training loop is stopped by ``save(async_=True)`` divided by a
  synchronous ``save()`` of the same state (target ≤ 0.10);
- throughput: training steps/s while the background write runs, divided by steps/s
  with no save running (target ≥ 0.9).
Rounds alternate sync and async saves in one fleet.
"""

from __future__ import annotations

import shutil
import statistics

from common import median, report

from workbench import Fleet

ROUNDS = 3
SETUP = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(16, 2048)
def step():
    loss = model(x).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
for _ in range(3):
    step()
state_mb = sum(p.to_local().numel() * 4 * 3 for p in model.parameters()) / 2**20  # params + 2 Adam moments
"""
MEASURE = """
from workbench.checkpoint.api import SAVES
t0 = time.perf_counter(); workbench.checkpoint.save(tag=f"sync-{i}"); sync_s = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(8):
    step()
normal_steps_s = 8 / (time.perf_counter() - t0)
t0 = time.perf_counter(); workbench.checkpoint.save(tag=f"async-{i}", async_=True); async_s = time.perf_counter() - t0
def all_done():  # every rank decides alike: a step is a collective
    flag = torch.tensor([int(SAVES.pending is None or SAVES.pending.done())])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())
during, t0 = 0, time.perf_counter()
while not all_done():
    step(); during += 1
during_s = time.perf_counter() - t0
workbench.checkpoint.wait()
(sync_s, async_s, normal_steps_s, during / during_s if during else None, during, state_mb)
"""


def main() -> dict:
    sync, blocked, normal, background, steps_during = [], [], [], [], []
    with Fleet(n=2, progress=False, wandb=False) as fleet:
        fleet.run(SETUP, strategy="fsdp", show_output=False)
        for i in range(ROUNDS):
            fleet.push(i=i)
            rows = fleet.run(MEASURE, strategy="fsdp", show_output=False)
            sync.append(max(r[0] for r in rows))
            blocked.append(max(r[1] for r in rows))
            normal.append(min(r[2] for r in rows))
            if all(r[3] for r in rows):
                background.append(min(r[3] for r in rows))
            steps_during.append(min(r[4] for r in rows))
        state_mb = sum(r[5] for r in rows)
        shutil.rmtree(fleet.checkpoints.folder, ignore_errors=True)
    return report("checkpoint", {
        "state_mb_total": state_mb,
        "sync_save_median_s": median(sync),
        "async_blocked_median_s": median(blocked),
        "ratio_async_blocked_over_sync": median(blocked) / median(sync),
        "target_blocked": "<= 0.02",
        "steps_per_s_normal": median(normal),
        "steps_per_s_during_background_write": median(background) if background else 0.0,
        "ratio_throughput_during_write": (median(background) / median(normal)) if background else 0.0,
        "target_throughput": ">= 0.9",
        "steps_during_each_write": steps_during,
        "rounds": ROUNDS,
        "sync_spread_s": statistics.pstdev(sync),
    })


if __name__ == "__main__":
    main()
