"""Soak: goodput under one SIGKILL every 60 s (target ≥ 0.95; torchft reports 0.81 at that rate).

A 3-rank fleet (``RANKS``; DDP by default: recovery takes a survivor's live state; ``fsdp``:
recovery loads the last checkpoint) with ``--auto-recover`` and one warm spare
trains with an async checkpoint every ``EVERY`` steps. First it trains fault-free for
``BASELINE_S`` seconds (steps/s); then for ``DURATION_S`` seconds a thread
SIGKILLs a random rank's engine every ``KILL_EVERY_S`` seconds. Goodput is the
useful steps/s of the faulty phase (steps kept at its end: those rolled back to
a checkpoint do not count) ÷ the fault-free steps/s.
``python bench/soak_elastic_goodput.py [DURATION_S] [ddp|fsdp] [RANKS]``. With 3 ranks a kill
leaves two survivors, which must agree on the live state (two ranks hide that).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

from common import report

from workbench import CellOptions, Fleet

BASELINE_S = 60.0
DURATION_S = 300.0
KILL_EVERY_S = 60.0
EVERY = 20  # steps between async checkpoints
RANKS = 3
SETUP = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
def _go_on():  # every rank decides alike (a step is a collective): a per-rank clock could split them
    flag = torch.tensor([float(time.time() < {deadline})])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())
while _go_on():
    loss = model(torch.randn(32, 512)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
    workbench.checkpoint.maybe_save(every={every}, async_=True)
workbench.step
"""


def train_until(fleet, seconds: float, strategy: str) -> tuple[int, float]:
    """Run the training cell for ``seconds``; return (steps kept, wall seconds)."""
    first = fleet.run("workbench.step", strategy=strategy, show_output=False)[0]
    started = time.time()
    code = TRAIN.format(deadline=started + seconds, every=EVERY)
    last = fleet.run(code, strategy=strategy, show_output=False)[0]
    return last - first, time.time() - started


def main(duration: float = DURATION_S, strategy: str = "ddp", ranks: int = RANKS) -> dict:
    kills: list[float] = []
    with Fleet(n=ranks, progress=False, wandb=False, auto_recover=True, max_restarts=1000, spares=1) as fleet:
        fleet.execute(SETUP, CellOptions(strategy=strategy), show_output=False, setup=True)
        train_until(fleet, 5.0, strategy)  # warm-up
        steps, wall = train_until(fleet, BASELINE_S, strategy)
        fault_free = steps / wall
        stop = threading.Event()

        def killer():
            while not stop.wait(KILL_EVERY_S):
                victim = fleet.member(random.randrange(fleet.world_size)).pid
                os.kill(victim, signal.SIGKILL)
                kills.append(time.time())
                print(f"killed pid {victim}", flush=True)

        thread = threading.Thread(target=killer, daemon=True)
        restarts = fleet.session.restarts
        thread.start()
        try:
            steps, wall = train_until(fleet, duration, strategy)
        finally:
            stop.set()
        useful = steps / wall
        restarts = fleet.session.restarts - restarts
    return report(f"soak_elastic_goodput_{strategy}", {
        "strategy": strategy,
        "ranks": ranks,
        "fault_free_steps_per_s": fault_free,
        "useful_steps_per_s_with_kills": useful,
        "goodput": useful / fault_free,
        "target_goodput": ">= 0.95",
        "kills": len(kills),
        "auto_recoveries": restarts,
        "seconds": wall,
        "checkpoint_every_steps": EVERY,
    })


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else DURATION_S, sys.argv[2] if len(sys.argv) > 2 else "ddp",
         int(sys.argv[3]) if len(sys.argv) > 3 else RANKS)
