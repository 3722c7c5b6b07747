"""Rescaling a real fleet mid-session: 2 -> 3 -> 2 keeps model and optimizer state exactly."""

from __future__ import annotations

import contextlib
import importlib
import re

import pytest
from conftest import fleet_processes, wait_until_gone

from workbench import Fleet, FleetError, OptionsError

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


@contextlib.contextmanager
def hang_timeout(fleet, seconds: float):
    """Run with ``fleet.options.hang_timeout = seconds``; back to what it was afterwards."""
    before, fleet.options.hang_timeout = fleet.options.hang_timeout, seconds
    try:
        yield
    finally:
        fleet.options.hang_timeout = before


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
    with pytest.raises(OptionsError, match="at most 4096 ranks"):  # refused before anything is built
        elastic.scale(99999999999999999999)
    with pytest.raises(OptionsError, match="CPU engines need about"):  # this machine's memory, before launching
        elastic.scale(400)
    assert elastic.world_size == 2
    with pytest.raises(OptionsError, match="--setup cell runs on every rank"):
        elastic.execute("x = 1", fleet_options("ddp"), ranks=[0], setup=True)


def fleet_options(strategy):
    from workbench import CellOptions

    return CellOptions(strategy=strategy)


def test_recover_right_after_a_kill_replaces_an_engine_still_exiting(elastic):
    """The notebook's order: SIGKILL, then %fleet recover at once. If the engine had not yet exited
    when recover looked, the teardown finds it dead, and recover replaces it then."""
    import os
    import signal

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    fleet.checkpoints.save(tag="before-late-kill")
    victim = fleet.member(1).pid
    os.kill(victim, signal.SIGKILL)
    assert not wait_until_gone([victim])
    real, calls = fleet.pool.dead_ranks, []

    def not_yet(settle_s=2.0):  # the first look came before the exit (a race on a busy machine)
        calls.append(settle_s)
        return [] if len(calls) == 1 else real(settle_s)

    fleet.pool.dead_ranks = not_yet
    try:
        result = fleet.recover()
    finally:
        del fleet.pool.dead_ranks
    assert len(calls) >= 2 and result["replaced"] == [1] and result["checkpoint"] == "before-late-kill"
    assert fleet.run("world_size", strategy="fsdp", show_output=False) == [2, 2]


def test_scale_after_a_death_says_recover_in_one_line(elastic):
    import os
    import signal

    fleet = elastic
    fleet.execute(SETUP, fleet_options("ddp"), show_output=False, setup=True)
    victim = fleet.member(1).pid
    os.kill(victim, signal.SIGKILL)
    assert not wait_until_gone([victim])
    with pytest.raises(FleetError, match=r"^the engine of rank 1 .* died.*Run %fleet recover"):
        fleet.scale(3)
    assert fleet.world_size == 2
    fleet.recover()
    assert fleet.run("world_size", show_output=False) == [2, 2]


def test_an_engine_killed_during_scale_is_replaced_and_the_scale_completes(elastic, capfd):
    """Rank 1 dies after the rescale checkpoint, before the new group is built (the probe saw
    'IndexError: No such engine', then every recover() waited out the group timeout)."""
    import os
    import signal
    import time

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    fleet.run(TRAIN, strategy="fsdp", show_output=False)
    before = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    victim = fleet.member(1).pid
    add_engines = fleet.pool.add_engines

    killed = []

    def kill_then_add(slots, launched=None):
        if not killed:  # the scale's own new engine, not the replacement
            killed.append(os.kill(victim, signal.SIGKILL))
        add_engines(slots, launched)

    fleet.pool.add_engines = kill_then_add
    started = time.monotonic()
    try:
        fleet.scale(3)
    finally:
        del fleet.pool.add_engines
    assert time.monotonic() - started < 60
    assert re.search(r"rank 1 of \d died \(engine", capfd.readouterr().err)
    assert victim not in {m.pid for m in fleet.members} and fleet.world_size == 3 and not fleet.session.fresh_ranks
    for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
        _equal(before, got)
    fleet.scale(2)


def test_a_live_engine_is_never_reported_dead(elastic):
    headline, cause = elastic.pool.loss(0)  # what a rank the hub unregistered while its process lives is told
    assert headline == f"rank 0 of {elastic.world_size} lost contact (engine {elastic.member(0).engine_id}, pid {elastic.member(0).pid}, process alive)"
    assert "lost contact with rank 0" in cause and "process is alive" in cause and "died" not in cause


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
    headline = str(outcome["error"])  # the root cause leads, not rank 0's "Connection closed by peer"
    assert re.match(rf"rank 1 of 2 died \(engine \d+, pid {victim}, SIGKILL\); the other", headline), headline
    assert report.splitlines()[0].startswith("── rank 1 of 2 died"), report
    assert re.search(r"^rank 0: \w+: .* \(because of it\)$", report, re.M), report
    assert "── full tracebacks of the other ranks ──" in report  # kept, after the summary
    print(f"SIGKILL to headline: {time.monotonic() - killed_at:.2f} s")
    assert "the engine of rank 1 (engine " in report and f"pid {victim}) died" in report, report
    assert "OOM killer" in report and "run %fleet recover next" in report
    assert "accelerator.prepare again" not in report, "one recovery path: the advice that ended in a hang is gone"
    with pytest.raises(FleetError, match=r"rank 1 was replaced by a fresh engine .*run %fleet recover first"):
        fleet.execute(SETUP, fleet_options("fsdp"), show_output=False)  # re-running setup would split the ranks
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


def _signal_during_training(fleet, target: int, pid: int, sig: int) -> dict:
    """Run LOOP (with checkpoints) in a thread, send ``sig`` to ``pid`` 2 s in (past a checkpoint
    or two, well before the end: 80 steps take > 4 s), and wait for the cell to end."""
    import os
    import threading
    import time

    outcome = {}

    def train():
        outcome["loss"] = fleet.run(LOOP.format(target=target, save=True), strategy="fsdp", show_output=False)

    worker = threading.Thread(target=train)
    worker.start()
    time.sleep(2.0)
    os.kill(pid, sig)
    worker.join(120)
    assert not worker.is_alive()
    return outcome


def test_auto_recover_reruns_the_cell_and_reaches_the_uninterrupted_result(elastic):
    import signal

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    start = fleet.checkpoints.save(tag="auto-start")
    target = fleet.run("workbench.step", strategy="fsdp", show_output=False)[0] + 80
    reference_loss = fleet.run(LOOP.format(target=target, save=False), strategy="fsdp", show_output=False)
    reference = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
    fleet.checkpoints.restore(start)
    fleet.options.auto_recover, fleet.options.max_restarts, fleet.session.restarts = True, 1, 0
    try:
        outcome = _signal_during_training(fleet, target, fleet.member(1).pid, signal.SIGKILL)
    finally:
        fleet.options.auto_recover = False
    assert fleet.session.restarts == 1, "recovered once, then the cell ran again to the end"
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
    with pytest.raises(FleetError, match=r"the engine of rank 2 \(engine \d+, pid \d+\) died.*Run %fleet recover"):
        fleet.run("1", show_output=False)
    result = fleet.recover(shrink=True)
    assert fleet.world_size == 2 and result["replaced"] == [2]
    for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
        _equal(saved, got)


def test_a_frozen_rank_is_caught_by_its_heartbeat_and_auto_recovered(elastic):
    """SIGSTOP: the engine is alive (its process exists, ipyparallel still lists it) but
    does nothing. Its heartbeat stops; the rank is killed and replaced, and the cell runs again."""
    import signal

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    target = fleet.run("workbench.step", strategy="fsdp", show_output=False)[0] + 80
    frozen = fleet.member(1).pid
    fleet.options.auto_recover, fleet.options.max_restarts, fleet.session.restarts = True, 1, 0
    try:
        with hang_timeout(fleet, 3.0):
            outcome = _signal_during_training(fleet, target, frozen, signal.SIGSTOP)
    finally:
        fleet.options.auto_recover = False
    assert fleet.session.restarts == 1 and "loss" in outcome
    assert fleet.run("workbench.step", strategy="fsdp", show_output=False) == [target, target]
    assert not wait_until_gone([frozen], timeout=10), "the frozen engine was killed"


DEADLOCK = """
import threading, time
lock = threading.Lock()
for i in range(40):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
    time.sleep(0.05)
    if i == 10 and rank == 1:
        lock.acquire()
        lock.acquire()  # never returns
"""


def test_a_deadlocked_rank_is_reported_with_its_stack_and_the_fleet_stays_usable(elastic):
    from workbench import DistributedCellError

    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    pids = [m.pid for m in fleet.members]
    with hang_timeout(fleet, 3.0), pytest.raises(DistributedCellError) as caught:
        fleet.run(DEADLOCK, strategy="fsdp", show_output=False)
    error = caught.value
    report = error.report()
    assert 1 in error.hung and "rank 1 hung: no progress" in report, report
    assert "lock.acquire()  # never returns" in report, "the stack shows where rank 1 is stuck"
    assert [m.pid for m in fleet.members] == pids, "SIGINT stopped the deadlock: no engine was replaced"
    assert fleet.run("rank", show_output=False) == [0, 1]


def test_a_cell_without_progress_or_with_a_late_heartbeat_is_not_judged_hung(elastic):
    """A plain sleep shows no progress; and rank 1, paused for 1.6 s as a busy machine
    would delay it, misses a beat. Neither is a hang, even with a 1 s hang timeout."""
    import os
    import signal
    import threading
    import time

    fleet = elastic
    late = fleet.member(1).pid

    def pause_rank_1():
        os.kill(late, signal.SIGSTOP)
        time.sleep(1.6)
        os.kill(late, signal.SIGCONT)

    pauser = threading.Timer(0.8, pause_rank_1)
    try:
        with hang_timeout(fleet, 1.0):
            pauser.start()
            assert fleet.run("import time; time.sleep(4); rank", show_output=False) == [0, 1]
    finally:
        pauser.join()
        with contextlib.suppress(ProcessLookupError):  # killed as hung: the assert above said so
            os.kill(late, signal.SIGCONT)


def test_training_that_pauses_between_steps_is_not_judged_hung(elastic):
    """Progress, then 2.2 s without (data loading, an eval): not a hang under --hang-timeout 1."""
    fleet = elastic
    fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
    pids = [m.pid for m in fleet.members]
    with hang_timeout(fleet, 1.0):
        fleet.run("import time\nfor _ in range(2):\n" + TRAIN.replace("\n", "\n    ") + "\n    time.sleep(2.2)",
                  strategy="fsdp", show_output=False)
    assert [m.pid for m in fleet.members] == pids


def _ready_spare(fleet, timeout=60.0) -> int:
    import time

    deadline = time.monotonic() + timeout
    while not fleet.spare_status()["ready"]:
        assert time.monotonic() < deadline, "a spare engine registered"
        time.sleep(0.2)
    return fleet.spare_status()["ready"][0]["pid"]


@pytest.mark.fleet
def test_warm_spares_take_new_and_lost_ranks():
    import os
    import signal

    with Fleet(n=2, spares=1, progress=False, wandb=False) as fleet:
        spare = _ready_spare(fleet)
        fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
        fleet.run(TRAIN, strategy="fsdp", show_output=False)
        before = fleet.run(SNAPSHOT, strategy="fsdp", show_output=False)[0]
        fleet.scale(3)
        assert fleet.member(2).pid == spare and spare not in [s["pid"] for s in fleet.spare_status()["ready"]]
        for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
            _equal(before, got)
        second = _ready_spare(fleet)  # started in the background to replace the one taken
        assert second not in {m.pid for m in fleet.members}
        lost = fleet.member(1).pid
        os.kill(lost, signal.SIGKILL)
        assert not wait_until_gone([lost])
        result = fleet.recover()
        assert result["replaced"] == [1] and fleet.member(1).pid == second
        for got in fleet.run(SNAPSHOT, strategy="fsdp", show_output=False):
            _equal(before, got)
        pids = [m.pid for m in fleet.members] + [s["pid"] for s in fleet.spare_status()["ready"]]
    assert not wait_until_gone(pids, timeout=10), "ranks and spares are gone after stop"


@pytest.mark.fleet
def test_recover_without_a_checkpoint_puts_every_rank_at_the_same_state():
    """Sharded (FSDP) state has no live replica: without a checkpoint every rank starts over."""
    import os
    import signal

    params = "({n: p.full_tensor() for n, p in model.named_parameters()}, workbench.step)"
    with Fleet(n=2, progress=False, wandb=False) as fleet:
        fleet.execute(SETUP, fleet_options("fsdp"), show_output=False, setup=True)
        fleet.run(TRAIN, strategy="fsdp", show_output=False)
        assert fleet.run("workbench.step", strategy="fsdp", show_output=False) == [4, 4]
        victim = fleet.member(1).pid
        os.kill(victim, signal.SIGKILL)
        assert not wait_until_gone([victim])
        result = fleet.recover()
        assert result["checkpoint"] is None and result["source"] is None and result["replaced"] == [1]
        (p0, step0), (p1, step1) = fleet.run(params, strategy="fsdp", show_output=False)
        assert step0 == step1 == 0, "the survivor is not left at step 4 while the new rank is at 0"
        assert all((p0[k] == p1[k]).all() for k in p0)

        # DDP: the survivor holds the whole state, so recover takes it from there (live replica)
        fleet.execute(SETUP, fleet_options("ddp"), show_output=False, setup=True)
        weights = "{n: p.detach().clone() for n, p in model.named_parameters()}"
        start = fleet.run(weights, show_output=False)[0]
        target = 40
        reference_loss = fleet.run(LOOP.format(target=target, save=False), show_output=False)
        reference = fleet.run(SNAPSHOT, show_output=False)[0]
        fleet.execute(SETUP, fleet_options("ddp"), show_output=False, setup=True)  # the same initial model
        fleet.client[fleet.engine_ids()].apply_sync(importlib.import_module("workbench.rank.engine").set_step, 0)
        again = fleet.run(weights, show_output=False)[0]
        assert all((start[k] == again[k]).all() for k in start)
        victim = fleet.member(1).pid
        failed = _kill_during(fleet, LOOP.format(target=target, save=False), victim, after_s=1.5)
        assert "rank 1 of 2 died" in failed
        result = fleet.recover()
        assert result["source"] == 0 and result["checkpoint"] is None and result["replaced"] == [1]
        assert 0 < result["step"] < target and {"model", "optimizer"} <= set(result["restored"])
        assert not fleet.checkpoints.list(), "no checkpoint was ever taken"
        assert fleet.run(LOOP.format(target=target, save=False), show_output=False) == reference_loss
        for got in fleet.run(SNAPSHOT, show_output=False):
            _equal(reference, got)  # bit-exact with the uninterrupted run


def _kill_during(fleet, code: str, pid: int, after_s: float) -> str:
    """Run ``code`` in a thread, SIGKILL ``pid`` after ``after_s``; return the cell's error headline."""
    import os
    import signal
    import threading
    import time

    from workbench import DistributedCellError

    outcome = {}

    def run():
        try:
            fleet.run(code, show_output=False)
        except DistributedCellError as exc:
            outcome["error"] = str(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(after_s)
    os.kill(pid, signal.SIGKILL)
    worker.join(120)
    assert not worker.is_alive()
    return outcome.get("error", "")




SLOW_TRAIN = """
import time
g = torch.Generator().manual_seed(1000 * world_size + rank + workbench.step)
for _ in range(20):
    if globals().get("slow_engine"):  # this engine is slow (set on rank 1 only): not the code
        time.sleep(0.04)
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
"""


def test_a_slow_rank_is_flagged_and_replaced_keeping_the_state(elastic, capfd):
    """Rank 1's engine sleeps 40 ms a step: within 20 steps it (and not rank 0, which waits
    for it in DDP's all-reduce) is flagged; --auto-replace-stragglers swaps it for a fresh
    engine after the cell, with the survivors' state, and the next cell has no straggler."""
    fleet = elastic
    fleet.session.restarts = 0  # earlier tests may have spent the budget
    fleet.execute(SETUP, fleet_options("ddp"), show_output=False, setup=True)
    fleet.run(TRAIN, show_output=False)
    assert fleet.stragglers() == {}
    fleet.client[fleet.engine_ids([1])].execute("slow_engine = True", block=True)
    fleet.run(SLOW_TRAIN, show_output=False)
    slow = fleet.stragglers()
    assert list(slow) == [1] and slow[1] > 1.3, slow
    assert capfd.readouterr().err.count("rank 1 is slow: its compute per step") == 1
    assert [row["state"].split()[0] for row in fleet.status()] == ["idle", "slow"]
    fleet.run(SLOW_TRAIN, show_output=False)
    assert "rank 1 is slow" not in capfd.readouterr().err, "named once"

    before = fleet.run(SNAPSHOT, show_output=False)
    slow_pid = fleet.member(1).pid
    fleet.options.auto_replace_stragglers = True
    try:
        fleet.run(SLOW_TRAIN, show_output=False)  # flagged again in its new group window: replaced after it
    finally:
        fleet.options.auto_replace_stragglers = False
    err = capfd.readouterr().err
    assert re.search(r"auto-recover 1/\d+: rank 1 is slow", err), err[-2000:]
    assert slow_pid not in {m.pid for m in fleet.members} and fleet.world_size == 2
    after = fleet.run(SNAPSHOT, show_output=False)
    assert after[0][2] == after[1][2] == before[0][2] + 20  # the step count goes on
    for got in after:
        _equal(got, after[0])  # every rank has the same state
    fleet.run(SLOW_TRAIN, show_output=False)  # the fresh engine is not slow
    assert fleet.stragglers() == {}
    fleet.session.restarts = 0
