"""Parking an idle fleet (issue 39, item 3): its engines stop, the next cell brings it back where it
was, bit for bit; names parking would lose are said; --park-after parks by itself."""

from __future__ import annotations

import time

import psutil
import pytest
from conftest import wait_until_gone

from workbench import CellOptions, Fleet, FleetError

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier

SETUP = """
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = iter(loader)
"""
TRAIN = """
target = workbench.step + 5
while workbench.step < target:
    try:
        x, y = next(batches)
    except StopIteration:
        batches = iter(loader)
        continue
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step(); optimizer.zero_grad()
"""
WEIGHTS = "[p.detach().clone() for p in model.parameters()]"


def test_park_then_the_next_cell_goes_on_bit_exact_with_no_engine_while_parked(capsys):
    with Fleet(n=2, progress=False, wandb=False, tensorboard=False) as fleet:
        fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
        fleet.run(TRAIN, show_output=False)
        tag = fleet.checkpoints.save(tag="at-5")
        fleet.run(TRAIN, show_output=False)
        uninterrupted = fleet.run(WEIGHTS, show_output=False)
        fleet.checkpoints.restore(tag)
        fleet.run("losses = []", show_output=False)  # made by no setup cell: parking loses it, and says so
        engines = [m.pid for m in fleet.members]
        capsys.readouterr()
        fleet.park()
        said = capsys.readouterr().err
        assert "workbench: parked 2 ranks in" in said and "not kept: loss, losses, target, x, y)" in said, said
        assert wait_until_gone(engines) == [], "a parked fleet holds no engine (no GPU)"
        assert fleet.running and fleet.parked.world == 2 and fleet.world_size == 0
        assert "device-hours" in fleet.usage.line(0, "cpu")
        assert _panel_state(fleet)["parked"]["world"] == 2, "the lab panel shows it parked (with Unpark)"
        fleet.run(TRAIN, show_output=False)  # the next cell brings it back first
        assert "unparked: 2 ranks back in" in capsys.readouterr().err
        resumed = fleet.run(WEIGHTS, show_output=False)
        assert fleet.run("workbench.step", show_output=False) == [10, 10]
        for want, got in zip(uninterrupted, resumed, strict=True):
            assert all(a.equal(b) for a, b in zip(want, got, strict=True)), "parking changed the training"
        with pytest.raises(FleetError, match="not parked: rank 0 holds names no setup cell makes"):
            fleet.park(anyway=False)
        assert fleet.parked is None


def _panel_state(fleet) -> dict:
    from types import SimpleNamespace

    from workbench.kernel import panel

    before = panel._session
    panel._session = SimpleNamespace(current_fleet=lambda: fleet, current_metrics=lambda: fleet.metrics)
    try:
        return panel.snapshot()
    finally:
        panel._session = before


def test_park_after_parks_an_idle_fleet_by_itself_and_a_cell_brings_it_back():
    with Fleet(n=2, progress=False, wandb=False, tensorboard=False, park_after="2s", park_anyway=True) as fleet:
        fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
        engines = [m.pid for m in fleet.members]
        deadline = time.monotonic() + 30
        while fleet.parked is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.parked is not None, "not parked after 2 s without a command"
        assert wait_until_gone(engines) == []
        assert fleet.run("world_size", show_output=False) == [2, 2]
        assert not any(psutil.pid_exists(p) for p in engines)


def test_park_after_takes_a_time_and_refuses_nonsense_in_one_line():
    with pytest.raises(Exception, match=r"--park-after takes a time like 30m, 2h or 90s \(got 'soon'\)"):
        Fleet(n=2, park_after="soon")
