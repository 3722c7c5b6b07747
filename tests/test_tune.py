"""workbench.tune / Fleet.tune: short trials of a real training step on real ranks, a real
out-of-memory as a result, and the trained state left as it was."""

from __future__ import annotations

import pytest

from workbench import Fleet, OptionsError

SETUP = """
import torch
import torch.nn as nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 1))

def make_batch(size):
    return torch.randn(size, 16), torch.randn(size, 1)

def step(model, batch):
    X, y = batch
    return nn.functional.mse_loss(model(X), y)

def checksum(m):
    return sum(p.detach().double().sum().item() for p in m.parameters())

model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(3):  # a model with a trained state
    accelerator.backward(step(model, make_batch(8)))
    optimizer.step()
    optimizer.zero_grad()
"""
STATE = "checksum(model), workbench.step, torch.get_rng_state().double().sum().item()"


@pytest.fixture(scope="module")
def tuned_fleet():
    # a real memory limit (the address space of each engine): a huge micro-batch fails to allocate
    with Fleet(n=2, progress=False, wandb=False, tensorboard=False, memory_limit="6G") as fleet:
        fleet.run(SETUP, show_output=False)
        yield fleet


@pytest.fixture
def fleet(tuned_fleet):
    """The module's fleet; the cell defaults a tune applied are undone after each test, passed or failed."""
    before = tuned_fleet.cell_defaults
    yield tuned_fleet
    tuned_fleet.cell_defaults = before


def test_trials_measure_every_configuration_and_an_out_of_memory_ends_its_series(fleet):
    before = fleet.run(STATE, show_output=False)
    records = len(fleet.metrics.store)
    # 2**22 samples need 64 GiB of activations: a real allocation failure under the 6G limit
    result = fleet.tune("step", "model", "make_batch", micro_batches=[8, 64, 2**22, 2**23],
                        strategies=["ddp", "fsdp"], steps=2, warmup=1)
    rows = [(t.strategy, t.micro_batch, t.status) for t in result.trials]
    assert rows == [("ddp", 8, "ok"), ("ddp", 64, "ok"), ("ddp", 2**22, "out of memory"),
                    ("ddp", 2**23, "skipped: 4194304 was already too big"),
                    ("fsdp", 8, "ok"), ("fsdp", 64, "ok"), ("fsdp", 2**22, "out of memory"),
                    ("fsdp", 2**23, "skipped: 4194304 was already too big")], result.table()
    fitting = [t for t in result.trials if t.ok]
    assert all(t.samples_per_s > 0 and t.peak_memory > 2**20 for t in fitting)
    assert result.best == max(fitting, key=lambda t: t.samples_per_s)
    table = result.table()
    assert "samples/s" in table and "peak memory" in table and "<- fastest" in table and "out of memory" in table

    # nothing the trials did stays: parameters, workbench.step, the RNG, the run's metrics
    assert fleet.run(STATE, show_output=False) == before
    assert len(fleet.metrics.store) == records

    # the fastest is the next cells' default; the trained model still trains with the rebuilt accelerator
    best = result.best
    assert fleet.cell_defaults.strategy == best.strategy and fleet.cell_defaults.grad_accum == best.grad_accum
    kind, size = fleet.run("accelerator.distributed_type.value, micro_batch_size", show_output=False)[0]
    assert kind == ("FSDP" if best.strategy == "fsdp" else "MULTI_CPU") and size == best.micro_batch
    fleet.run("accelerator.backward(step(model, make_batch(8))); optimizer.step(); optimizer.zero_grad()",
              strategy="ddp", show_output=False)
    assert fleet.run("workbench.step", strategy="ddp", show_output=False) == [before[0][1] + 1] * 2


def test_global_batch_is_kept_by_accumulation_and_max_memory_rules_out_what_does_not_fit(fleet):
    result = fleet.tune("step", "build_model", "make_batch", micro_batches=[2, 8192], global_batch=16384,
                        strategies=["ddp"], steps=1, warmup=1, apply=False)
    assert [(t.micro_batch, t.grad_accum) for t in result.trials] == [(2, 4096), (8192, 1)]
    small, big = result.trials
    assert big.peak_memory > small.peak_memory + 100 * 2**20, result.table()
    assert big.samples_per_s > small.samples_per_s, result.table()  # bigger micro-batches are faster here ...
    limit = (small.peak_memory + big.peak_memory) // 2
    result = fleet.tune("step", "build_model", "make_batch", micro_batches=[2, 8192], global_batch=16384,
                        strategies=["ddp"], steps=1, warmup=1, max_memory=limit, apply=False)
    assert [t.status for t in result.trials] == ["ok", "over --max-memory"], result.table()
    assert result.best.micro_batch == 2  # ... but only the small one fits
    assert fleet.cell_defaults == type(fleet.cell_defaults)(), "apply=False leaves the defaults"


def test_bad_tune_input_is_one_line_before_any_trial(fleet):
    with pytest.raises(OptionsError, match="no micro-batch size divides --global-batch 30"):
        fleet.tune("step", "model", "make_batch", micro_batches=[4, 8], global_batch=30)
    with pytest.raises(OptionsError, match="unknown strategy to tune 'zero3'"):
        fleet.tune("step", "model", "make_batch", strategies=["zero3"])
    with pytest.raises(OptionsError, match="--max-memory takes a size"):
        fleet.tune("step", "model", "make_batch", max_memory="lots")
    from workbench import DistributedCellError

    with pytest.raises(DistributedCellError, match="'no_such_step' is not defined"):
        fleet.tune("no_such_step", "model", "make_batch", micro_batches=[8])
