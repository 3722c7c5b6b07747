"""Rescaling a real fleet mid-session: 2 -> 3 -> 2 keeps model and optimizer state exactly."""

from __future__ import annotations

import pytest
from conftest import fleet_processes, wait_until_gone

from workbench import Fleet, OptionsError

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
g = torch.Generator().manual_seed(1000 * world_size + rank + workbench.step)
for _ in range(4):
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
"""
SNAPSHOT = """
def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
({n: _full(p) for n, p in model.named_parameters()},
 [_full(optimizer.optimizer.state[p]["exp_avg"]) for p in model.parameters()], workbench.step, world_size)
"""


def _equal(a, b):
    assert a[0].keys() == b[0].keys()
    assert all((a[0][k] == b[0][k]).all() for k in a[0])
    assert all((x == y).all() for x, y in zip(a[1], b[1], strict=True))
    assert a[2] == b[2]


@pytest.fixture(scope="module")
def elastic():
    with Fleet(n=2, progress=False, wandb=False) as f:
        yield f


def test_scale_up_and_down_keeps_state_exactly(elastic):
    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    fleet.run(TRAIN, strategy="fsdp", show_output=False)
    before = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    pids_before = {m.pid for m in fleet.members}
    result = fleet.scale(3)
    assert fleet.world_size == 3 and set(result["timings"]) == {
        "checkpoint", "teardown", "engines", "rendezvous", "setup", "restore"}
    assert {"model", "optimizer"} <= set(result["restored"])
    after = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)
    for got in after:
        _equal(before, got)
    assert [a[3] for a in after] == [3, 3, 3]
    assert fleet.run("tuple(model[0].weight.to_local().shape)", strategy="fsdp", show_output=False) == [
        (22, 16), (22, 16), (20, 16)]  # torch.chunk sizes
    fleet.run(TRAIN, strategy="fsdp", show_output=False)  # training goes on at 3 ranks from workbench.step
    assert fleet.run("workbench.step", strategy="fsdp", show_output=False) == [before[2] + 4] * 3
    at_three = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    removed = fleet.member(2).pid
    fleet.scale(2)
    assert fleet.world_size == 2
    assert not wait_until_gone([removed], timeout=10), "the removed engine is gone"
    for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
        _equal(at_three, got)
    assert pids_before <= {m.pid for m in fleet.members} | pids_before
    assert removed not in {p.pid for p in fleet_processes()}


def test_bad_scale_requests(elastic):
    with pytest.raises(OptionsError, match="already has 2 ranks"):
        elastic.scale(2)
    with pytest.raises(OptionsError, match="whole number of ranks"):
        elastic.scale(0)
    with pytest.raises(OptionsError, match="--setup cell runs on every rank"):
        elastic.execute("x = 1", fleet_options("ddp"), ranks=[0], setup=True)


def fleet_options(strategy):
    from workbench import CellOptions

    return CellOptions(strategy=strategy)


def test_a_killed_engine_is_recovered_from_the_last_checkpoint(elastic):
    import os
    import signal
    import threading
    import time

    from workbench import DistributedCellError

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    fleet.run(TRAIN, strategy="fsdp", show_output=False)
    tag = fleet.checkpoints.save(tag="before-crash")
    saved = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    victim = fleet.member(1).pid
    outcome = {}

    def train():
        try:
            fleet.run("import time\nfor _ in range(200):\n" + TRAIN.replace("\n", "\n    ") + "\n    time.sleep(0.05)",
                      strategy="fsdp", show_output=False)
        except DistributedCellError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=train)
    worker.start()
    time.sleep(2)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    worker.join(60)
    assert not worker.is_alive(), "the surviving rank was released"
    assert time.monotonic() - killed_at < 30
    report = outcome["error"].report()
    assert "the engine of rank 1 (engine " in report and f"pid {victim}) died" in report, report
    assert "OOM killer" in report and "%fleet recover" in report
    result = fleet.recover()
    assert result["checkpoint"] == tag and {"model", "optimizer"} <= set(result["restored"])
    for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
        _equal(saved, got)
    fleet.run(TRAIN, strategy="fsdp", show_output=False)  # training runs again
    assert victim not in {m.pid for m in fleet.members}


LOOP = """
import time
while workbench.step < {target}:
    g = torch.Generator().manual_seed(workbench.step * 10 + rank)  # the data of a step depends on the step only
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
    if {save}:
        workbench.checkpoint.maybe_save(every=5, async_=False)
    time.sleep(0.05)
loss.item()
"""


def test_auto_recover_reruns_the_cell_and_reaches_the_uninterrupted_result(elastic):
    import os
    import signal
    import threading
    import time

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    start = fleet.checkpoints.save(tag="auto-start")
    target = fleet.run("workbench.step", strategy="fsdp", show_output=False)[0] + 80
    reference_loss = fleet.run(LOOP.format(target=target, save=False), strategy="fsdp", show_output=False)
    reference = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    fleet.checkpoints.restore(start)
    fleet.auto_recover, fleet.max_restarts, fleet.restarts = True, 1, 0
    outcome = {}

    def train():
        outcome["loss"] = fleet.run(LOOP.format(target=target, save=True), strategy="fsdp", show_output=False)

    try:
        worker = threading.Thread(target=train)
        worker.start()
        time.sleep(2.0)  # past a checkpoint or two, well before the end (80 steps take > 4 s)
        os.kill(fleet.member(1).pid, signal.SIGKILL)
        worker.join(120)
        assert not worker.is_alive()
    finally:
        fleet.auto_recover = False
    assert fleet.restarts == 1, "recovered once, then the cell ran again to the end"
    assert outcome["loss"] == pytest.approx(reference_loss, rel=1e-5)
    for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
        assert got[2] == target
        assert all(((got[0][k] - reference[0][k]).abs().max() < 1e-5) for k in reference[0])


def test_recover_with_shrink_goes_on_without_the_lost_rank(elastic):
    import os
    import signal
    import time

    from workbench import FleetError

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    fleet.run(TRAIN, strategy="fsdp", show_output=False)
    fleet.checkpoints.save(tag="before-shrink")
    saved = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    fleet.scale(3)
    victim = fleet.member(2).pid
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(FleetError, match="the engine of rank 2 died; run %fleet recover"):
        fleet.run("1", show_output=False)
    result = fleet.recover(shrink=True)
    assert fleet.world_size == 2 and result["replaced"] == [2]
    for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
        _equal(saved, got)
