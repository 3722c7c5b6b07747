"""(f) Elastic: a 2→3 rescale with resharded restore vs torchrun killed and relaunched at 3
ranks resuming from a DCP checkpoint of the same model (FSDP2 + AdamW, ~50 MB of state),
each measured until the first training step at 3 ranks has finished (target ratio ≤ 0.5),
with a cold start of the new engine and with a warm spare (``spares=1``); the time from
a SIGKILL of an engine to the kernel seeing the cell fail (target ≤ 5 s), and to a
training step finished again with ``--auto-recover`` (target ≤ 30 s).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

from common import median, quiet_env, report

from workbench import CellOptions, DistributedCellError, Fleet

HERE = pathlib.Path(__file__).parent
ROUNDS = 2
SETUP = f"""
import sys, time, torch
sys.path.insert(0, {str(HERE)!r})
from elastic_resume import WIDTH
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, WIDTH))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
def step():
    loss = model(torch.randn(16, WIDTH)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
"""
STEP = "step()\ntime.time()"


def torchrun(n: int, folder: str, mode: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        started = time.time()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                        str(HERE / "elastic_resume.py"), folder, mode, out.name],
                       check=True, env=quiet_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return float(open(out.name).read() or "nan") - started if mode == "resume" else 0.0


def rescale(spares: int) -> float:
    with Fleet(n=2, progress=False, wandb=False, spares=spares) as fleet:
        while len(fleet.spare_status()["ready"]) < spares:
            time.sleep(0.2)
        fleet.execute(SETUP, CellOptions(strategy="fsdp"), show_output=False, setup=True)
        fleet.run(STEP, strategy="fsdp", show_output=False)
        started = time.time()
        fleet.scale(3)
        return fleet.run(STEP, strategy="fsdp", show_output=False)[0] - started


def kill_and_recover() -> tuple[float, float]:
    """(SIGKILL → the kernel sees the cell fail, SIGKILL → a training step done again)."""
    with Fleet(n=2, progress=False, wandb=False, auto_recover=True) as fleet:
        fleet.execute(SETUP, CellOptions(strategy="fsdp"), show_output=False, setup=True)
        fleet.run(STEP, strategy="fsdp", show_output=False)
        outcome = {}

        def train():
            try:
                fleet.run("while True:\n    step()", strategy="fsdp", show_output=False)
            except DistributedCellError as exc:
                outcome["failed_at"] = exc.failed_at

        fleet.options.auto_recover = False
        worker = threading.Thread(target=train)
        worker.start()
        time.sleep(2)
        killed = time.time()
        os.kill(fleet.member(1).pid, signal.SIGKILL)
        worker.join()
        detected = outcome["failed_at"] - killed
        fleet.options.auto_recover = True
        fleet.recover()  # the one recovery recipe: the replaced rank is set up like the others
        fleet.checkpoints.save(tag="before-kill")
        killed = time.time()
        os.kill(fleet.member(1).pid, signal.SIGKILL)
        return detected, fleet.run(STEP, strategy="fsdp", show_output=False)[0] - killed


def main() -> dict:
    cold, warm, theirs, detect, recovery = [], [], [], [], []
    for _ in range(ROUNDS):
        folder = tempfile.mkdtemp(prefix="bench-elastic-")
        torchrun(2, folder, "save")
        theirs.append(torchrun(3, folder, "resume"))
        cold.append(rescale(spares=0))
        warm.append(rescale(spares=1))
        detected, recovered = kill_and_recover()
        detect.append(detected)
        recovery.append(recovered)
    return report("elastic", {
        "rescale_2to3_until_first_step_s": median(cold),
        "rescale_2to3_with_warm_spare_s": median(warm),
        "torchrun_relaunch_3_resume_until_first_step_s": median(theirs),
        "ratio_rescale_over_torchrun": median(cold) / median(theirs),
        "ratio_rescale_with_spare_over_torchrun": median(warm) / median(theirs),
        "target_ratio": "<= 0.3",
        "sigkill_to_cell_failed_s": median(detect),
        "target_detection_s": "<= 5",
        "sigkill_to_training_again_s": median(recovery),
        "target_recovery_s": "<= 5",
        "rounds": ROUNDS,
    })


if __name__ == "__main__":
    main()
