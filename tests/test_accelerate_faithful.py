"""Ranks are a faithful accelerate environment: user code that builds its own Accelerator gets
what torchrun + ``accelerate launch`` give it; user code may tear the group down; FSDP2 shards
per block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from workbench import CellOptions, OptionsError

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "accelerate_probe.py")
PROBE_CODE = open(PROBE).read().split('if __name__ == "__main__":')[0]


@pytest.fixture(scope="module")
def torchrun_reference():
    """The probe under ``torchrun --nproc-per-node 2`` with accelerate launch's CPU environment."""
    folder = tempfile.mkdtemp(prefix="probe-torchrun-")
    env = {**os.environ, "ACCELERATE_USE_CPU": "True", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    PROBE, folder], env=env, check=True, timeout=240, capture_output=True)
    return [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(2)]


@pytest.mark.parametrize("strategy", ["ddp", "none", "fsdp"])
def test_users_own_accelerator_behaves_as_under_torchrun(fleet, torchrun_reference, strategy):
    folder = tempfile.mkdtemp(prefix=f"probe-fleet-{strategy}-")
    got = fleet.run(PROBE_CODE + f"\nprobe({folder!r})", strategy=strategy)
    for rank in range(2):
        expected = dict(torchrun_reference[rank])
        if strategy == "fsdp":  # as `accelerate launch` with an FSDP config: the same world, sharded
            assert got[rank].pop("distributed_type") == "DistributedType.FSDP"
            expected.pop("distributed_type")
            assert got[rank].pop("parameter_sum_after_accumulation") == pytest.approx(
                expected.pop("parameter_sum_after_accumulation"), rel=1e-5)
        assert got[rank] == expected, rank


def test_strategy_none_is_distributed_but_unwrapped(fleet):
    got = fleet.run(
        "import torch\nm = accelerator.prepare(torch.nn.Linear(2, 2))\n"
        "(str(accelerator.distributed_type), type(m).__name__, accelerator.gather(torch.tensor([rank])).tolist())",
        strategy="none",
    )
    assert got == [("DistributedType.MULTI_CPU", "Linear", [0, 1])] * 2


ALL_REDUCE = "import torch, torch.distributed as dist\nt = torch.ones(1); dist.all_reduce(t); t.item()"


@pytest.mark.parametrize("teardown", [
    "accelerator.state.destroy_process_group()",  # accelerate's own end of training
    "from accelerate.state import AcceleratorState\nimport torch.distributed as dist\n"
    "dist.destroy_process_group(); AcceleratorState._reset_state(True)",
    "import torch.distributed as dist\ndist.destroy_process_group()\ndist.init_process_group('gloo')",
])
def test_a_cell_that_tears_the_group_down_leaves_a_working_fleet(fleet, capfd, teardown):
    fleet.run(teardown, strategy="ddp")
    assert "tore down the default process group" in capfd.readouterr().err
    assert fleet.run(ALL_REDUCE) == [2.0, 2.0]
    got = fleet.run("import torch\nstr(accelerator.distributed_type), accelerator.reduce(torch.ones(1)).item()")
    assert got == [("DistributedType.MULTI_CPU", 2.0)] * 2


def test_accelerate_state_reset_alone_rebuilds_the_accelerator(fleet):
    fleet.run("from accelerate.state import AcceleratorState\nAcceleratorState._reset_state(True)")
    got = fleet.run("import torch\nstr(accelerator.distributed_type), accelerator.gather(torch.tensor([rank])).tolist()")
    assert got == [("DistributedType.MULTI_CPU", [0, 1])] * 2


BLOCKS_MODEL = """
import torch, torch.nn as nn
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))
class Net(nn.Module):
    def __init__(self, d=32, n=8):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, d), nn.ModuleList(Block(d) for _ in range(n)), nn.Linear(d, 1)
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)
torch.manual_seed(0)
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
"""

TRAIN_AND_MEASURE = """
from workbench.parallel import UnshardedPeak, fsdp_unit_count
g = torch.Generator().manual_seed(1)
X = torch.randn(64, 8, generator=g); y = X[:, :1]
X, y = X[rank::world_size], y[rank::world_size]
peak = None
for step in range(5):
    if step == 1:
        meter = UnshardedPeak(model) if fsdp_unit_count(model) else None
    loss = nn.functional.mse_loss(model(X), y)
    if step == 1 and meter is not None:
        peak = (meter.bytes, meter.full_bytes); meter.__exit__()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
(fsdp_unit_count(model), loss.item(), peak)
"""


def test_fsdp_shards_every_block_then_the_root(fleet):
    fleet.run(BLOCKS_MODEL, strategy="ddp")
    ddp = fleet.run(TRAIN_AND_MEASURE, strategy="ddp")
    fleet.run(BLOCKS_MODEL, strategy="fsdp")
    per_block = fleet.run(TRAIN_AND_MEASURE, strategy="fsdp")
    one_unit_opts = CellOptions(strategy="fsdp", fsdp_wrap="none")
    fleet.run(BLOCKS_MODEL, options=one_unit_opts)
    one_unit = fleet.run(TRAIN_AND_MEASURE, options=one_unit_opts)
    by_class_opts = CellOptions(strategy="fsdp", fsdp_wrap="Block")
    fleet.run(BLOCKS_MODEL, options=by_class_opts)
    by_class = fleet.run(TRAIN_AND_MEASURE, options=by_class_opts)
    for rank in range(2):
        assert per_block[rank][0] == 9 and by_class[rank][0] == 9  # 8 blocks + the root
        assert one_unit[rank][0] == 1
        for other in (per_block, one_unit, by_class):
            assert other[rank][1] == pytest.approx(ddp[rank][1], rel=1e-4, abs=1e-6)
        peak, full = per_block[rank][2]
        block = full * 0.9 / 8  # the blocks hold ~90% of this model
        assert peak <= full - 8 * block + 2 * block + 1  # the root's own and at most two blocks (prefetch)
        assert one_unit[rank][2][0] == one_unit[rank][2][1] == full  # the whole model at once


def test_fsdp_wrap_refusals():
    with pytest.raises(OptionsError, match="--fsdp-wrap chooses FSDP units"):
        CellOptions(strategy="ddp", fsdp_wrap="none").validate("cpu")
    with pytest.raises(OptionsError, match="class names"):
        CellOptions(strategy="fsdp", fsdp_wrap="not a class").validate("cpu")


def test_fsdp_wrap_with_an_unknown_class_is_one_line(fleet):
    from workbench.kernel.execution import DistributedCellError

    with pytest.raises(DistributedCellError, match="matched no module of Net; its classes with parameters"):
        fleet.run(BLOCKS_MODEL, options=CellOptions(strategy="fsdp", fsdp_wrap="NoSuchLayer"))
