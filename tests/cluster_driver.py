"""Run on a simulated host by tests/test_cluster.py: a fleet whose ranks start on other hosts
through ipyparallel's ssh launcher. Prints one JSON line of results last.

``python cluster_driver.py placement '<ssh args>' '<hosts>' N '<more hosts>'``
``python cluster_driver.py host_loss '<ssh args>' '<hosts>' N``: prints ``CELL STARTED`` when a
long training cell starts (the test then kills or cuts off the last host).
"""

from __future__ import annotations

import json
import socket
import sys
import time

from workbench import CellOptions, Fleet
from workbench.status import status_rows, status_table

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
torch.manual_seed(100 + rank + workbench.step)
for _ in range(5):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
"""
PARAMS = "[p.full_tensor() if hasattr(p, 'full_tensor') else p.detach().clone() for p in model.parameters()]"
WHERE = "import os, socket; (socket.gethostname(), os.environ['MASTER_ADDR'], os.environ['LOCAL_RANK'], os.environ['NODE_RANK'])"


def same(a, b) -> bool:
    return all((x == y).all().item() for x, y in zip(a, b, strict=True))


def placement() -> None:
    ssh_args, hosts, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    result = {"kernel_host": socket.gethostname()}
    started = time.monotonic()
    with Fleet(n=n, launcher="ssh", hosts=hosts, launcher_options={"ssh_args": ssh_args}, engine_timeout=90,
               progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs") as fleet:
        result["start_s"] = time.monotonic() - started
        result["where"] = fleet.run(WHERE, show_output=False)
        result["status"] = status_table(status_rows(fleet.pool))
        fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
        fleet.run(TRAIN, show_output=False)
        params = fleet.run(PARAMS, show_output=False)
        result["ddp_ranks_agree"] = all(same(params[0], p) for p in params[1:])
        fleet.checkpoints.save(tag="two-hosts")
        fleet.run(TRAIN, show_output=False)
        result["trained_on"] = not same(params[0], fleet.run(PARAMS, show_output=False)[0])
        fleet.checkpoints.restore("two-hosts")
        restored = fleet.run(PARAMS, show_output=False)
        result["restore_exact"] = all(same(a, b) for a, b in zip(params, restored, strict=True))
        scaled = time.monotonic()
        fleet.scale(n + 1)
        result["scale_s"] = time.monotonic() - scaled
        result["where_scaled"] = fleet.run(WHERE, show_output=False)
        after = fleet.run(PARAMS, show_output=False)
        result["scaled_state_kept"] = all(same(params[0], p) for p in after)
        fleet.run(TRAIN, show_output=False)
        params = fleet.run(PARAMS, show_output=False)
        result["ddp_ranks_agree_scaled"] = all(same(params[0], p) for p in params[1:])
        result["status_scaled"] = status_table(status_rows(fleet.pool))
        try:  # every slot is taken: refused in one line, nothing changed
            fleet.scale(n + 2)
        except Exception as exc:
            result["no_slot_error"] = f"{type(exc).__name__}: {exc}"
        result["ranks_after_refusal"] = fleet.world_size
        fleet.scale(n + 2, hosts=sys.argv[5])
        result["where_more_hosts"] = fleet.run(WHERE, show_output=False)
        result["state_on_more_hosts"] = all(same(params[0], p) for p in fleet.run(PARAMS, show_output=False))
        result["metrics_from_ranks"] = sorted(fleet.metrics.store.streams)  # records or heartbeats
        result["unsigned_metrics"] = fleet.metrics.collector.rejected
    print(json.dumps(result))


LONG_TRAIN = """
import time
print("CELL STARTED", flush=True)
for _ in range(400):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    time.sleep(0.05)
"""


def host_loss() -> None:
    ssh_args, hosts, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    result = {}
    with Fleet(n=n, launcher="ssh", hosts=hosts, launcher_options={"ssh_args": ssh_args}, engine_timeout=90,
               progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs") as fleet:
        fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
        fleet.run(TRAIN, show_output=False)
        try:
            fleet.run(LONG_TRAIN, show_output=True)
        except Exception as exc:
            result["failed_at"] = time.time()
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            result["notes"] = " ".join(getattr(exc, "notes", None) or [])
        try:  # no host has a free slot for the lost rank
            fleet.recover()
        except Exception as exc:
            result["recover_error"] = f"{type(exc).__name__}: {exc}"
        recovered = time.monotonic()
        fleet.recover(shrink=True)
        result["recover_s"] = time.monotonic() - recovered
        result["ranks_after"] = fleet.world_size
        result["where_after"] = fleet.run(WHERE, show_output=False)
        params = fleet.run(PARAMS, show_output=False)
        result["survivors_agree"] = all(same(params[0], p) for p in params[1:])
        result["step_after_recover"] = fleet.run("workbench.step", show_output=False)
        fleet.run(TRAIN, show_output=False)
        params = fleet.run(PARAMS, show_output=False)
        result["trains_on"] = all(same(params[0], p) for p in params[1:])
        result["step_after_training"] = fleet.run("workbench.step", show_output=False)
    print(json.dumps(result))


SLOW_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 3072), torch.nn.ReLU(), torch.nn.Linear(3072, 1024))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
"""
SLOW_TRAIN = """
import time
started = time.monotonic()
for _ in range(3):
    loss = model(torch.randn(16, 1024)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
time.monotonic() - started
"""


def slow_link() -> None:
    """DDP over a thin link (the test shapes it): the cell must not be called a mismatch."""
    ssh_args, hosts, n, strategy = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    result = {}
    with Fleet(n=n, launcher="ssh", hosts=hosts, launcher_options={"ssh_args": ssh_args}, engine_timeout=120,
               progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs") as fleet:
        fleet.run(SLOW_SETUP, strategy=strategy, show_output=False)
        try:
            result["seconds"] = fleet.run(SLOW_TRAIN, strategy=strategy, show_output=False)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        params = fleet.run(PARAMS, strategy=strategy, show_output=False)
        result["agree"] = all(same(params[0], p) for p in params[1:])
        result["comm_s"] = [sum(r.system.get("comm_s", 0.0) for r in fleet.metrics.store.since(0) if r.rank == rank)
                            for rank in range(n)]
        result["step_s"] = [sum(r.system.get("step_time_s", 0.0) for r in fleet.metrics.store.since(0)
                                if r.rank == rank) for rank in range(n)]
    print(json.dumps(result))


if __name__ == "__main__":
    {"placement": placement, "host_loss": host_loss, "slow_link": slow_link}[sys.argv[1]]()
