"""Checkpoints on real ranks: round trips, async, atomicity, bad input, resharding, faults."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import tempfile
import time

import psutil
import pytest
from conftest import wait_until_gone

from workbench import CheckpointError, DistributedCellError, Fleet
from workbench.checkpoint import layout
from workbench.kernel.testing import gate_checkpoint_writes, kill_rank_during_save, ungate_checkpoint_writes

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, {width}), torch.nn.ReLU(), torch.nn.Linear({width}, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
"""
TRAIN = """
torch.manual_seed(100 + rank + workbench.step)
for _ in range({steps}):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
"""
# full (gathered) parameters and optimizer state; collective for FSDP's DTensors
SNAPSHOT = """
def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
_params = {n.removeprefix("module."): _full(p) for n, p in model.named_parameters()}
_moments = [_full(optimizer.optimizer.state[p]["exp_avg"]) for p in model.parameters()]
(_params, _moments, scheduler.state_dict()["last_epoch"], workbench.step)
"""


def _same(a, b):
    params_a, moments_a, *rest_a = a
    params_b, moments_b, *rest_b = b
    assert params_a.keys() == params_b.keys()
    assert all((params_a[k] == params_b[k]).all() for k in params_a)
    assert all((x == y).all() for x, y in zip(moments_a, moments_b, strict=True))
    assert rest_a == rest_b


def _setup(fleet, strategy, width=32, steps=3):
    fleet.run(SETUP.format(width=width), strategy=strategy, show_output=False)
    fleet.run(TRAIN.format(steps=steps), strategy=strategy, show_output=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_save_then_restore_brings_everything_back(fleet, strategy):
    _setup(fleet, strategy)
    tag = fleet.checkpoints.save(tag=f"roundtrip-{strategy}")
    saved = fleet.run(SNAPSHOT, strategy=strategy, show_output=False)
    rng_after_save = fleet.run("torch.rand(3)", strategy=strategy, show_output=False)
    fleet.run(TRAIN.format(steps=4), strategy=strategy, show_output=False)
    with pytest.raises(AssertionError):
        _same(saved[0], fleet.run(SNAPSHOT, strategy=strategy, show_output=False)[0])
    report = fleet.checkpoints.restore(tag)
    assert {"model", "optimizer", "scheduler", "rng"} <= set(report["restored"])
    for before, after in zip(saved, fleet.run(SNAPSHOT, strategy=strategy, show_output=False), strict=True):
        _same(before, after)
    rng = fleet.run("torch.rand(3)", strategy=strategy, show_output=False)
    assert all((a == b).all() for a, b in zip(rng, rng_after_save, strict=True)), "RNG states restored per rank"
    if strategy == "fsdp":
        shards = fleet.run("type(model[0].weight).__name__", strategy=strategy, show_output=False)
        assert shards == ["DTensor", "DTensor"]
        files = layout.read_manifest(os.path.join(fleet.checkpoints.folder, tag)).files
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files), "each rank wrote its own shard"


def test_the_dataloader_position_is_restored(fleet):
    """Three optimizer steps into an epoch: the position is those steps' batches; the rest of the
    pass comes next (also in the same process, after the break), then whole passes."""
    fleet.run("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "net = torch.nn.Linear(1, 1)\n"
              "net, opt, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1),\n"
              "    DataLoader(TensorDataset(torch.arange(64.)), batch_size=4))\n"
              "seen = []\nfor (batch,) in loader:\n    accelerator.backward(net(batch[:, None]).sum()); opt.step()\n"
              "    seen.append(batch.tolist())\n    if len(seen) == 3:\n        break",
              show_output=False)
    fleet.checkpoints.save(tag="mid-epoch")
    rest = fleet.run("[b.tolist() for (b,) in loader]", show_output=False)  # the pass goes on after the break
    for rank in (0, 1):  # batches are dealt round-robin: rank r has batches r, r+2, ...
        assert rest[rank] == [list(map(float, range(4 * k, 4 * k + 4))) for k in range(6 + rank, 16, 2)]
    report = fleet.checkpoints.restore("mid-epoch")
    assert "loader" in report["restored"]
    assert fleet.run("[b.tolist() for (b,) in loader]", show_output=False) == rest
    assert fleet.run("len([b for b in loader])", show_output=False) == [8, 8], "then whole passes"
    fleet.run("del net, opt, loader", show_output=False)


def test_list_shows_complete_checkpoints_with_their_manifest(fleet):
    _setup(fleet, "ddp")
    fleet.checkpoints.save(tag="listed")
    entry = next(e for e in fleet.checkpoints.list() if e.tag == "listed")
    assert entry.state == "complete"
    m = entry.manifest
    assert (m.world_size, m.strategy, m.complete) == (2, "ddp", True) and m.size > 0
    assert m.step == fleet.run("workbench.step", show_output=False)[0]
    table = fleet.checkpoints.table()
    assert table.splitlines()[0].split() == ["tag", "step", "world", "size", "strategy", "size", "time", "state"]
    assert any(line.startswith("listed ") for line in table.splitlines())
    modes = {name: oct(os.stat(os.path.join(entry.path, name)).st_mode & 0o777) for name in os.listdir(entry.path)}
    assert set(modes.values()) == {"0o600"}, modes  # shards and manifest: owner only
    assert oct(os.stat(fleet.metrics.jsonl_path).st_mode & 0o777) == "0o600"
    with pytest.raises(CheckpointError, match="already exists"):
        fleet.checkpoints.save(tag="listed")


def test_async_save_returns_before_writing_and_training_goes_on(fleet, tmp_path):
    _setup(fleet, "fsdp")
    gate = tmp_path / "gate"
    gate_checkpoint_writes(fleet, str(gate))  # writes wait until the gate opens
    try:
        fleet.checkpoints.save(tag="async-gated", async_=True)  # returns: the state is staged, not written
        assert [e.state for e in fleet.checkpoints.list() if e.tag == "async-gated"] == ["writing"]
        steps = fleet.run("workbench.step", show_output=False)
        fleet.run(TRAIN.format(steps=3), strategy="fsdp", show_output=False)  # training goes on meanwhile
        assert fleet.run("workbench.step", show_output=False) == [s + 3 for s in steps]
        assert "async-gated" not in [e.tag for e in fleet.checkpoints.list() if e.state == "complete"]
        gate.touch()
        fleet.checkpoints.save(tag="after-async")  # waits for the first save
    finally:
        gate.touch()
        ungate_checkpoint_writes(fleet)
    states = {e.tag: e.state for e in fleet.checkpoints.list()}
    assert states["async-gated"] == "complete" and states["after-async"] == "complete"
    manifest = layout.read_manifest(os.path.join(fleet.checkpoints.folder, "async-gated"))
    assert manifest.step == steps[0], "the async checkpoint holds the state at the time of the call"


BN_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
"""
BN_SNAPSHOT = SNAPSHOT.replace("(_params,", "(_params, [b.clone() for b in model.buffers()],")
SLOW_STAGING = """
import time
from workbench.checkpoint.api import SAVES
_stager = SAVES.staging()
_stage = _stager._stage
def _slow_stage(state_dict, **kwargs):  # the copy starts after the loop's next steps have begun
    time.sleep(0.5)
    return _stage(state_dict, **kwargs)
_stager._stage = _slow_stage
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_async_checkpoint_holds_the_state_of_the_call_while_the_loop_goes_straight_on(fleet, strategy):
    """Staging runs while the next forward and backward do (the forward changes BatchNorm's
    buffers in place; the optimizer step waits for the copy): the checkpoint still holds
    exactly the state at the call."""
    fleet.run(BN_SETUP, strategy=strategy, show_output=False)
    fleet.run(TRAIN.format(steps=2), strategy=strategy, show_output=False)
    before = fleet.run(BN_SNAPSHOT, strategy=strategy, show_output=False)
    tag = f"staged-{strategy}"
    fleet.run(SLOW_STAGING, show_output=False)
    try:
        fleet.run(f"workbench.checkpoint.save(tag={tag!r}, async_=True)\n" + TRAIN.format(steps=3),
                  strategy=strategy, show_output=False)
    finally:
        fleet.run("_stager._stage = _stage", show_output=False)
    fleet.checkpoints.wait()
    with pytest.raises(AssertionError):
        _same_bn(before[0], fleet.run(BN_SNAPSHOT, strategy=strategy, show_output=False)[0])
    fleet.checkpoints.restore(tag)
    after = fleet.run(BN_SNAPSHOT, strategy=strategy, show_output=False)
    # DCP keeps one copy of an unsharded tensor: every rank gets one rank's buffers back (DDP
    # makes them equal at the next forward anyway by broadcasting rank 0's)
    source = next(b for b in before if _equal(b[1], after[0][1]))
    for saved, restored in zip(before, after, strict=True):
        _same_bn(saved, restored, buffers=source[1])


def _equal(xs, ys) -> bool:
    return all((x == y).all() for x, y in zip(xs, ys, strict=True))


def _same_bn(a, b, buffers=None):
    """``buffers``: what b's buffers must be; default a's."""
    params_a, buffers_a, *rest_a = a
    params_b, buffers_b, *rest_b = b
    assert _equal(buffers if buffers is not None else buffers_a, buffers_b), "buffers"
    _same((params_a, *rest_a), (params_b, *rest_b))


def test_keep_last_and_maybe_save(fleet):
    _setup(fleet, "ddp")
    # an optimizer step with no gradients changes nothing, but it is a step: workbench.step counts it
    fleet.run("for _ in range(6):\n    optimizer.step()\n    workbench.checkpoint.maybe_save(every=2, async_=False, keep_last=2)",
              show_output=False)
    complete = [e.tag for e in fleet.checkpoints.list() if e.state == "complete"]
    step = fleet.run("workbench.step", show_output=False)[0]
    last = step - step % 2  # the newest multiple of `every` (the fleet's step depends on the tests before)
    assert complete[-2:] == [f"step-{last - 2}", f"step-{last}"]
    assert f"step-{last - 4}" not in complete, "older ones deleted"
    # by default maybe_save keeps its newest 3 periodic checkpoints and never a tag of the user's
    fleet.checkpoints.save(tag="mine")
    fleet.run("for _ in range(10):\n    optimizer.step()\n    workbench.checkpoint.maybe_save(every=2, async_=False)",
              show_output=False)
    step = fleet.run("workbench.step", show_output=False)[0]
    complete = [e.tag for e in fleet.checkpoints.list() if e.state == "complete"]
    last = step - step % 2
    periodic = sorted(t for t in complete if t.startswith("step-"))  # other tests' own tags stay too
    assert "mine" in complete and periodic == sorted(f"step-{s}" for s in (last - 4, last - 2, last)), complete
    fleet.run("optimizer.step()", show_output=False)
    newest = fleet.checkpoints.save(keep_last=1)
    assert [e.tag for e in fleet.checkpoints.list() if e.state == "complete"] == [newest]


def test_save_to_another_folder_then_restore_its_newest(fleet, tmp_path):
    _setup(fleet, "ddp")
    fleet.checkpoints.save(tag="first", to=str(tmp_path))
    fleet.run(TRAIN.format(steps=1), strategy="ddp", show_output=False)
    fleet.checkpoints.save(tag="second", to=str(tmp_path))
    saved = fleet.run(SNAPSHOT, strategy="ddp", show_output=False)
    fleet.run(TRAIN.format(steps=2), strategy="ddp", show_output=False)
    assert [e.tag for e in fleet.checkpoints.list(str(tmp_path))] == ["first", "second"]
    assert "second" not in [e.tag for e in fleet.checkpoints.list()]
    assert fleet.checkpoints.restore(str(tmp_path))["tag"] == "second"  # a folder of checkpoints: its newest
    _same(saved[0], fleet.run(SNAPSHOT, strategy="ddp", show_output=False)[0])
    assert oct(os.stat(tmp_path / "second").st_mode & 0o777) == "0o700"


def test_incomplete_and_corrupt_checkpoints_are_never_used(fleet):
    _setup(fleet, "ddp")
    tag = fleet.checkpoints.save(tag="good")
    folder = fleet.checkpoints.folder
    stale = os.path.join(folder, f"{layout.TMP_PREFIX}crashed-abc123")
    os.makedirs(os.path.join(stale, layout.WRITERS))
    open(os.path.join(stale, layout.WRITERS, "999999"), "w").close()  # a writer that is gone
    shutil.copytree(os.path.join(folder, tag), os.path.join(folder, "nomanifest"))
    os.remove(os.path.join(folder, "nomanifest", layout.MANIFEST))
    shutil.copytree(os.path.join(folder, tag), os.path.join(folder, "truncated"))
    with open(os.path.join(folder, "truncated", "__1_0.distcp"), "r+b") as f:
        f.truncate(10)
    tags = [e.tag for e in fleet.checkpoints.list()]
    assert "nomanifest" not in tags and "truncated" not in tags and "crashed" not in tags
    assert not os.path.exists(stale), "an abandoned temporary folder is cleaned up"
    assert layout.resolve(folder, "latest").endswith(f"/{tag}")
    with pytest.raises(CheckpointError, match="incomplete"):
        fleet.checkpoints.restore("nomanifest")
    with pytest.raises(CheckpointError, match="corrupt: __1_0.distcp has 10 bytes"):
        fleet.checkpoints.restore("truncated")
    with pytest.raises(CheckpointError, match="no checkpoint named 'nope'; complete checkpoints: .*good"):
        fleet.checkpoints.restore("nope")


@pytest.mark.parametrize("damage", ["files-null", "created-string", "manifest-folder", "no-files", "outside"])
def test_a_damaged_manifest_never_breaks_listing_or_other_restores(fleet, damage):
    import json

    _setup(fleet, "ddp")
    good = fleet.checkpoints.save(tag=f"good-{damage}")
    folder = fleet.checkpoints.folder
    bad = os.path.join(folder, f"bad-{damage}")
    shutil.copytree(os.path.join(folder, good), bad)
    path = os.path.join(bad, layout.MANIFEST)
    data = json.load(open(path))
    if damage == "manifest-folder":
        os.remove(path)
        os.mkdir(path)
    else:
        data.update({"files-null": {"files": None}, "created-string": {"created": "yesterday", "step": 10**6},
                     "no-files": {"files": {}}, "outside": {"files": {"../../../etc/passwd": 1}}}[damage])
        json.dump(data, open(path, "w"))
    assert f"bad-{damage}" not in [e.tag for e in fleet.checkpoints.list()]
    assert layout.resolve(folder, "latest").endswith(f"/{good}")
    with pytest.raises(CheckpointError, match=f"checkpoint 'bad-{damage}' is corrupt"):
        fleet.checkpoints.restore(f"bad-{damage}")
    fleet.checkpoints.restore(good)  # another, good tag still restores


def test_mismatched_shapes_name_the_keys_and_change_nothing(fleet):
    _setup(fleet, "ddp", width=32)
    tag = fleet.checkpoints.save(tag="width32")
    _setup(fleet, "ddp", width=48)
    before = fleet.run(SNAPSHOT, show_output=False)
    with pytest.raises(CheckpointError, match=r"does not fit: model 'model': 0.weight is \(32, 16\) in the checkpoint, \(48, 16\) here"):
        fleet.checkpoints.restore(tag)
    _same(before[0], fleet.run(SNAPSHOT, show_output=False)[0])


def test_metadata_that_would_run_code_is_refused(fleet, tmp_path):
    _setup(fleet, "ddp")
    tag = fleet.checkpoints.save(tag="tampered")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(fleet.checkpoints.folder, tag, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    manifest = os.path.join(fleet.checkpoints.folder, tag, layout.MANIFEST)
    text = open(manifest).read()
    import json

    data = json.loads(text)
    data["files"][".metadata"] = os.path.getsize(os.path.join(fleet.checkpoints.folder, tag, ".metadata"))
    open(manifest, "w").write(json.dumps(data))
    with pytest.raises(CheckpointError, match="unsafe.*posix.system is not allowed"):
        fleet.checkpoints.restore(tag)
    assert not marker.exists()


@contextlib.contextmanager
def _tmpfs(size: str, readonly=False):
    path = tempfile.mkdtemp(prefix="workbench-tmpfs-")
    options = f"size={size}" + (",ro" if readonly else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True)
    if done.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path])
        os.rmdir(path)


@contextlib.contextmanager
def _checkpoints_on(fleet, target):
    folder = fleet.checkpoints.folder
    moved = folder + ".real"
    if os.path.exists(folder):
        os.rename(folder, moved)
    os.symlink(target, folder)
    try:
        yield
    finally:
        os.remove(folder)
        if os.path.exists(moved):
            os.rename(moved, folder)


def test_a_full_disk_and_an_unwritable_folder_give_clear_errors(fleet, capsys):
    _setup(fleet, "fsdp", width=2048)  # ~1 MB of state per rank
    with _tmpfs("256k") as small, _checkpoints_on(fleet, small):
        with pytest.raises(CheckpointError, match="No space left on device") as failed:  # one line, not a traceback per rank
            fleet.checkpoints.save(tag="toobig")
        assert "\n" not in str(failed.value)
        assert os.listdir(small) == [], "nothing half-written is left behind"
        fleet.checkpoints.save(tag="toobig-async", async_=True)
        capsys.readouterr()
        for _ in range(50):  # the next cell after the background write failed reports it, once
            assert fleet.run("1", strategy="fsdp", show_output=False) == [1, 1]
            reported = capsys.readouterr().err
            if "background save" in reported:
                break
            time.sleep(0.1)
        assert "background save of checkpoint 'toobig-async' failed: " in reported, reported
        assert "No space left on device" in reported, reported
        assert os.listdir(small) == []
        fleet.run("1", strategy="fsdp", show_output=False)
        assert "background save" not in capsys.readouterr().err
    with _tmpfs("1m", readonly=True) as readonly, _checkpoints_on(fleet, readonly):
        with pytest.raises(CheckpointError, match="cannot write checkpoints to .*Read-only file system"):
            fleet.checkpoints.save(tag="ro")
    fleet.checkpoints.save(tag="after-disk-errors")


def test_restore_without_a_fleet_is_refused():
    fleet = Fleet(n=2, progress=False)
    with pytest.raises(CheckpointError, match="no fleet is running"):
        fleet.checkpoints.restore()


@pytest.mark.parametrize("first, second", [("fsdp", "fsdp"), ("ddp", "fsdp"), ("fsdp", "ddp")])
def test_restore_into_another_world_size_and_back(fleet, first, second, three_ranks):
    _setup(fleet, first)
    tag = fleet.checkpoints.save(tag=f"reshard-{first}-{second}")
    saved = fleet.run(SNAPSHOT, strategy=first, show_output=False)[0]
    path = os.path.join(fleet.checkpoints.folder, tag)
    three_ranks.run(SETUP.format(width=32), strategy=second, show_output=False)
    report = three_ranks.checkpoints.restore(path)
    assert report["saved_world_size"] == 2 and report["world_size"] == 3
    for got in three_ranks.run(SNAPSHOT, strategy=second, show_output=False):
        _same(saved, got)
    back = three_ranks.checkpoints.save(tag="from-three")
    fleet.run(SETUP.format(width=32), strategy=first, show_output=False)
    fleet.checkpoints.restore(os.path.join(three_ranks.checkpoints.folder, back))
    for got in fleet.run(SNAPSHOT, strategy=first, show_output=False):
        _same(saved, got)
    shutil.rmtree(os.path.join(three_ranks.checkpoints.folder, back))


@pytest.fixture(scope="module")
def three_ranks():
    with Fleet(n=3, progress=False, wandb=False) as f:
        yield f


def test_sigkill_of_a_rank_during_a_save_keeps_the_last_checkpoint(fleet, tmp_path):
    from workbench import CellOptions, FleetError

    fleet.execute(SETUP.format(width=32), CellOptions(strategy="fsdp"), show_output=False, setup=True)
    fleet.run(TRAIN.format(steps=3), strategy="fsdp", show_output=False)
    good = fleet.checkpoints.save(tag="before-kills")
    try:
        for attempt in range(3):
            error = kill_rank_during_save(fleet, victim=1 if attempt % 2 == 0 else 0, gate=str(tmp_path / "gate"))
            assert isinstance(error, DistributedCellError), error
            assert "died (SIGKILL): its process vanished" in error.report() and "was replaced" in error.report()
            assert layout.resolve(fleet.checkpoints.folder, "latest").endswith(f"/{good}")
            assert not [e for e in fleet.checkpoints.list() if e.state == "writing"]
            assert not [n for n in os.listdir(fleet.checkpoints.folder) if n.startswith(layout.TMP_PREFIX)]
            with pytest.raises(FleetError, match="run %fleet recover first"):
                fleet.run("rank", show_output=False)  # the new engine starts empty: one recipe, recover
            assert fleet.recover()["checkpoint"] == good
            assert len(fleet.run("rank", show_output=False)) == 2, "the dead rank was replaced"
    finally:
        fleet.session.forget_setup()
    assert fleet.checkpoints.save(tag="after-kills") == "after-kills"


def test_a_rank_killed_during_an_async_save_does_not_break_the_recovery(fleet, tmp_path, capfd):
    import signal as signals

    from workbench import CellOptions

    fleet.execute(SETUP.format(width=32), CellOptions(strategy="fsdp"), show_output=False, setup=True)
    fleet.run(TRAIN.format(steps=3), strategy="fsdp", show_output=False)
    good = fleet.checkpoints.save(tag="before-async-kill")
    gate = tmp_path / "gate"
    gate_checkpoint_writes(fleet, str(gate))
    try:
        fleet.checkpoints.save(tag="async-broken", async_=True)  # staged; the writes wait at the gate
        writers = fleet.run("from workbench.rank_state import STATE as _s\n_s.writer.process.pid", show_output=False)
        assert len(set(writers)) == 2 and all(psutil.pid_exists(pid) for pid in writers)
        os.kill(fleet.member(1).pid, signals.SIGKILL)
        assert wait_until_gone([writers[1]], timeout=5) == [], "the writer process dies with its rank"
        time.sleep(0.5)
        gate.touch()  # rank 0 writes, its peer is gone: its background save fails
        result = fleet.recover()
        assert result["checkpoint"] == good and result["replaced"] == [1]
        assert "async-broken" not in [e.tag for e in fleet.checkpoints.list()]
        assert len(fleet.run("rank", strategy="fsdp", show_output=False)) == 2
    finally:
        gate.touch()
        fleet.session.forget_setup()
        ungate_checkpoint_writes(fleet)
