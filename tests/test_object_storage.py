"""Checkpoints on object storage: a local S3 server (moto, on 127.0.0.1) and real ranks."""

from __future__ import annotations

import json
import os
import pickle
import time

import psutil
import pytest

from workbench import CheckpointError, Fleet
from workbench.checkpoint import layout
from workbench.checkpoint.storage import store_for
from workbench.kernel.flags import checkpoint_parser
from workbench.kernel.testing import LocalS3, gate_checkpoint_writes, ungate_checkpoint_writes
from workbench.options import CellOptions

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs 'moto[server]')")
pytest.importorskip("moto", reason="moto is not installed (pip install 'moto[server]')")

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
torch.manual_seed(100 + rank + workbench.step)
for _ in range({steps}):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
"""
PARAMS = """
{n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
 for n, p in model.named_parameters()}
"""


@pytest.fixture(scope="module")
def s3():
    with LocalS3("ckpt") as server:
        yield server


@pytest.fixture(scope="module")
def s3_fleet(s3):
    fleet = Fleet(2, checkpoint_dir=s3.url("run1"), progress=False).start()
    yield fleet
    fleet.stop()


def _setup(fleet, strategy: str) -> None:
    """The model as a --setup cell: scale and recover replay it."""
    fleet.execute(SETUP, CellOptions(strategy=strategy), show_output=False, setup=True)


def _objects(prefix: str) -> list[str]:
    """Every object under ``prefix``, as paths relative to it."""
    fs = store_for(prefix).fs
    fs.invalidate_cache()
    key = prefix.removeprefix("s3://")
    return sorted(name[len(key) + 1:] for name in fs.find(key))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_save_on_two_ranks_restore_on_three(s3, s3_fleet, tmp_path):
    fleet = s3_fleet
    _setup(fleet, "fsdp")
    fleet.run(TRAIN.format(steps=3), strategy="fsdp", show_output=False)
    assert fleet.checkpoints.folder == s3.url("run1")
    fleet.checkpoints.save(tag="two")
    saved = fleet.run(PARAMS, strategy="fsdp", show_output=False)[0]
    fleet.checkpoints.save(tag="two-async", async_=True)
    fleet.run(TRAIN.format(steps=2), strategy="fsdp", show_output=False)
    fleet.checkpoints.wait()
    listed = {e.tag: e for e in fleet.checkpoints.list()}
    assert {"two", "two-async"} <= {t for t, e in listed.items() if e.state == "complete"}
    assert listed["two"].path == s3.url("run1", "two") and listed["two"].manifest.world_size == 2
    files = _objects(s3.url("run1", "two"))
    assert "manifest.json" in files and ".metadata" in files and not any(f.startswith(".writers") for f in files)
    assert not os.path.exists(os.path.join(fleet.run_dir, "checkpoints")), "nothing is written locally"
    files = fleet.checkpoints.export("two", str(tmp_path / "hf"))  # straight from S3
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert files == ["model.safetensors"] and _same(saved, exported)

    fleet.scale(3)  # through the S3 checkpoint folder
    fleet.run("pass", strategy="fsdp", show_output=False)
    report = fleet.checkpoints.restore("two")
    assert report["saved_world_size"] == 2 and report["world_size"] == 3
    restored = fleet.run(PARAMS, strategy="fsdp", show_output=False)
    assert all(_same(saved, r) for r in restored), "FSDP shards saved by 2 ranks restore exactly into 3"
    fleet.run(TRAIN.format(steps=1), strategy="fsdp", show_output=False)  # and training goes on
    fleet.scale(2)


def test_list_rm_and_restore_by_url(s3, s3_fleet):
    fleet = s3_fleet
    _setup(fleet, "ddp")
    fleet.run(TRAIN.format(steps=2), strategy="ddp", show_output=False)
    elsewhere = s3.url("elsewhere")
    fleet.checkpoints.save(tag="a", to=elsewhere)
    saved = fleet.run(PARAMS, strategy="ddp", show_output=False)[0]
    fleet.run(TRAIN.format(steps=1), strategy="ddp", show_output=False)
    fleet.checkpoints.save(tag="b", to=elsewhere + "/")
    assert [e.tag for e in fleet.checkpoints.list(elsewhere)] == ["a", "b"]
    assert "a" not in [e.tag for e in fleet.checkpoints.list()]
    assert fleet.checkpoints.table(elsewhere).splitlines()[1].startswith("a ")
    fleet.run(TRAIN.format(steps=2), strategy="ddp", show_output=False)
    report = fleet.checkpoints.restore(elsewhere + "/a")  # a checkpoint's URL
    assert report["tag"] == "a" and _same(saved, fleet.run(PARAMS, strategy="ddp", show_output=False)[0])
    assert fleet.checkpoints.restore(elsewhere)["tag"] == "b"  # a folder of checkpoints: its newest
    fleet.checkpoints.save(tag="gone")
    fleet.checkpoints.remove("gone")
    assert _objects(s3.url("run1", "gone")) == [] and "gone" not in [e.tag for e in fleet.checkpoints.list()]
    with pytest.raises(CheckpointError, match="no checkpoint named 'gone'"):
        fleet.checkpoints.restore("gone")


def test_an_async_save_killed_midway_is_never_listed_and_the_next_save_removes_it(s3, s3_fleet, tmp_path):
    fleet = s3_fleet
    _setup(fleet, "ddp")
    fleet.run(TRAIN.format(steps=2), strategy="ddp", show_output=False)
    fleet.checkpoints.save(tag="before-kill")
    gate = str(tmp_path / "gate")
    gate_checkpoint_writes(fleet, gate)
    fleet.checkpoints.save(tag="killed", async_=True)  # staged; the writes wait at the gate
    assert [e.state for e in fleet.checkpoints.list() if e.tag == "killed"] == ["writing"]
    victim = fleet.member(0)  # the rank that would write the manifest
    os.kill(victim.pid, 9)
    open(gate, "w").close()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(victim.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)  # rank 1 writes its shard, then DCP's finish fails without rank 0
    os.remove(gate)
    leftover = _objects(s3.url("run1", "killed"))
    assert any(f.endswith(".distcp") for f in leftover) and "manifest.json" not in leftover, leftover
    assert "killed" not in [e.tag for e in layout.list_checkpoints(s3.url("run1"), clean=False)
                            if e.state == "complete"]
    with pytest.raises(CheckpointError, match="incomplete"):
        layout.read_manifest(s3.url("run1", "killed"))
    fleet.recover()  # rank 1 was killed mid-save: recovery replaces rank 0 and restores
    ungate_checkpoint_writes(fleet)
    fleet.run(TRAIN.format(steps=1), strategy="ddp", show_output=False)
    fleet.checkpoints.save(tag="after-kill", async_=True)
    fleet.checkpoints.wait()
    assert _objects(s3.url("run1", "killed")) == [], "the next save removed the dead save's objects"
    assert {"before-kill", "after-kill"} <= {e.tag for e in fleet.checkpoints.list() if e.state == "complete"}


def test_bad_urls_and_missing_buckets_get_one_line_before_anything_starts(s3, s3_fleet):
    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(CheckpointError, match=r"^cannot write checkpoints to s3://no-such-bucket/x: bucket "
                                              r"'no-such-bucket' does not exist \(create it first"):
        Fleet(2, checkpoint_dir="s3://no-such-bucket/x", progress=False).start()
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
                and "ipengine" in " ".join(p.info["cmdline"] or [])], "no engine was started"
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket' does not exist") as info:
        s3_fleet.checkpoints.save(tag="x", to="s3://no-such-bucket/x")
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match=r"^nosuch:// is not a storage that fsspec knows"):
        s3_fleet.checkpoints.save(tag="x", to="nosuch://x/y")
    with pytest.raises(CheckpointError, match="no checkpoint folder at s3://ckpt/nothing-here"):
        s3_fleet.checkpoints.restore(s3.url("nothing-here"))
    import boto3

    assert "no-such-bucket" not in [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]], \
        "a save never creates a bucket"


def test_remote_metadata_that_would_run_code_is_refused_and_credentials_stay_out(s3, s3_fleet, tmp_path):
    fleet = s3_fleet
    _setup(fleet, "ddp")
    fleet.checkpoints.save(tag="honest")
    store = store_for(s3.url("run1"))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    store.fs.pipe_file("ckpt/run1/honest/.metadata", pickle.dumps(Evil()))
    manifest = json.loads(store.read_text(s3.url("run1", "honest", "manifest.json")))
    manifest["files"][".metadata"] = len(pickle.dumps(Evil()))
    store.fs.pipe_file("ckpt/run1/honest/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="unsafe|not allowed"):
        fleet.checkpoints.restore("honest")
    assert not marker.exists()
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    for root, _dirs, names in os.walk(fleet.run_dir):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                assert secret.encode() not in f.read(), f"the secret key is in {name}"
    record = json.load(open(os.path.join(fleet.run_dir, "run.json")))
    assert record["options"]["checkpoint_dir"] == s3.url("run1")


def test_the_save_flags_parse():
    args = checkpoint_parser().parse_line("save --tag t --to s3://b/p --async")
    assert (args.tag, args.to, args.async_) == ("t", "s3://b/p", True)
    assert checkpoint_parser().parse_line("list s3://b/p").folder == "s3://b/p"
    assert checkpoint_parser().parse_line("restore s3://b/p/t").tag == "s3://b/p/t"
