"""accelerate strategies on real gloo ranks: DDP, FSDP2 (really sharded on CPU), none."""

from __future__ import annotations

import pytest

from workbench import CellOptions

SETUP = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
"""

TRAIN = """
g = torch.Generator().manual_seed(1)
X = torch.randn(128, 16, generator=g); y = X[:, :1] * 2 - X[:, 1:2]
X, y = X[rank::world_size], y[rank::world_size]
losses = []
for step in range(30):
    loss = nn.functional.mse_loss(model(X), y)
    accelerator.backward(loss)
    optimizer.step(); optimizer.zero_grad()
    losses.append(loss.item())
losses
"""


def test_fsdp_parameters_are_dtensor_shards_of_one_over_world(fleet):
    fleet.run(SETUP, strategy="fsdp")
    info = fleet.run(
        "from torch.distributed.tensor import DTensor\n"
        "[(name, isinstance(p, DTensor), p.to_local().numel(), p.numel(), str(p.placements))"
        " for name, p in model.named_parameters()]\n",
        strategy="fsdp",
    )
    assert fleet.run("str(accelerator.distributed_type)", strategy="fsdp") == ["DistributedType.FSDP"] * 2
    for rank_params in info:
        for name, is_dtensor, local, full, placements in rank_params:
            assert is_dtensor, name
            assert "Shard(dim=0)" in placements
            if full >= 16:
                assert abs(local / full - 0.5) <= 0.5 / 8 + 1e-9, (name, local, full)
    # the shards of rank 0 and 1 together hold every element exactly once
    for p0, p1 in zip(*info, strict=True):
        assert p0[2] + p1[2] == p0[3]


def test_fsdp_trains_to_the_same_loss_as_ddp(fleet):
    fleet.run(SETUP, strategy="ddp")
    ddp = fleet.run(TRAIN, strategy="ddp")
    assert fleet.run("type(model).__name__", strategy="ddp") == ["DistributedDataParallel"] * 2
    fleet.run(SETUP, strategy="fsdp")
    fsdp = fleet.run(TRAIN, strategy="fsdp")
    for rank in range(2):
        assert ddp[rank][-1] < 0.3 * ddp[rank][0]  # it really trained
        assert fsdp[rank][-1] == pytest.approx(ddp[rank][-1], rel=1e-3, abs=1e-5)


def test_strategy_none_leaves_the_model_unwrapped(fleet):
    fleet.run(SETUP, strategy="none")
    assert fleet.run("type(model).__name__", strategy="none") == ["Sequential"] * 2


def test_bf16_mixed_precision_on_cpu_and_grad_accum(fleet):
    got = fleet.run(
        SETUP + "with accelerator.autocast():\n    out = nn.functional.linear(torch.ones(2, 16), torch.ones(3, 16))\n"
        "(accelerator.mixed_precision, str(out.dtype), accelerator.gradient_accumulation_steps)",
        strategy="ddp", mixed_precision="bf16", grad_accum=4,
    )
    assert got == [("bf16", "torch.bfloat16", 4)] * 2


def test_changing_flags_rebuilds_the_accelerator_and_same_flags_reuse_it(fleet):
    first = fleet.run("id(accelerator)", grad_accum=2)
    again = fleet.run("id(accelerator)", grad_accum=2)
    other = fleet.run("(id(accelerator), accelerator.gradient_accumulation_steps)", grad_accum=3)
    assert first == again
    assert [o[1] for o in other] == [3, 3]


def test_cell_options_validation_is_pure():
    assert CellOptions(strategy="fsdp", mixed_precision="bf16", grad_accum=2).validate("cpu").strategy == "fsdp"
    assert CellOptions(strategy="ddp", mixed_precision="fp16").validate("cuda").mixed_precision == "fp16"
