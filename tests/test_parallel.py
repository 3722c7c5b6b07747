"""Comm hooks, HSDP, tensor and pipeline parallelism and activation checkpointing on real
gloo ranks, checked against plain DDP / FSDP or a single-process run of the same model."""

from __future__ import annotations

import pytest

from workbench import CellOptions, Fleet, OptionsError
from workbench.parallel import ParallelPlan


@pytest.mark.parametrize(("options", "world", "message"), [
    (dict(pp=2, comm_hook="fp16"), 2, "--comm-hook compresses DDP"),
    (dict(strategy="fsdp", comm_hook="fp16"), 2, "--comm-hook compresses DDP"),
    (dict(comm_hook="int8"), 2, "unknown --comm-hook"),
    (dict(comm_hook="powersgd:0"), 2, "powersgd:RANK needs a whole number"),
    (dict(comm_hook="fp16:2"), 2, "takes no rank"),
    (dict(tp=4), 2, "larger than the world"),
    (dict(tp=3, strategy="fsdp"), 4, "does not divide"),
    (dict(tp=2), 4, "shard it with --strategy fsdp"),
    (dict(strategy="hsdp", mesh="2x3"), 4, "has 6 ranks but the fleet has 4"),
    (dict(strategy="hsdp", mesh="2by2"), 4, "REPLICATExSHARD"),
    (dict(mesh="2x2"), 4, "use it with --strategy hsdp"),
    (dict(pp=2, tp=2, strategy="fsdp"), 4, "at most one of"),
    (dict(pp=2), 4, "must equal the world size"),
    (dict(pp=2, strategy="fsdp"), 2, "cannot shard a stage"),
    (dict(pp=2, mixed_precision="bf16"), 2, "full precision"),
    (dict(pp=4, microbatches=2, schedule="1f1b"), 4, "at least as many microbatches"),
    (dict(pp=2, schedule="zigzag"), 2, "unknown --schedule"),
    (dict(tp=0), 2, "--tp must be a whole number"),
    (dict(comm_hook="powersgd:2"), 2, "powersgd needs nccl"),
])
def test_impossible_combinations_are_refused_in_one_line(options, world, message):
    with pytest.raises(OptionsError, match=message) as caught:
        CellOptions(**options).validate("cpu", world, backend="gloo")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("options", "world", "nodes", "degrees", "mesh"), [
    (dict(), 4, 1, (4, 1, 1, 1), None),  # ddp: every rank a replica
    (dict(strategy="fsdp"), 4, 1, (1, 4, 1, 1), None),
    (dict(strategy="hsdp"), 4, 2, (2, 2, 1, 1), ((2, 2), ("replicate", "shard"))),  # shard in a node
    (dict(strategy="hsdp", mesh="1x4"), 4, 2, (1, 4, 1, 1), ((1, 4), ("replicate", "shard"))),
    (dict(strategy="fsdp", tp=2), 4, 1, (1, 2, 2, 1), ((2, 2), ("dp", "tp"))),
    (dict(tp=2), 2, 1, (1, 1, 2, 1), ((1, 2), ("dp", "tp"))),
    (dict(strategy="none", pp=4), 4, 1, (1, 1, 1, 4), ((4,), ("pp",))),
])
def test_a_cells_plan_has_one_degree_per_dimension_whose_product_is_the_world(options, world, nodes, degrees, mesh):
    plan = ParallelPlan.of(CellOptions(**options), world, nodes)
    assert (plan.replicate, plan.shard, plan.tp, plan.pp) == degrees and plan.ranks == world
    assert plan.mesh_dims == mesh


def test_each_strategy_is_one_registered_class_and_every_flag_choice_has_one():
    from workbench.options import STRATEGIES
    from workbench.parallel.data_parallel import STRATEGIES as REGISTERED
    from workbench.parallel.data_parallel import data_parallel

    assert sorted(REGISTERED) == sorted(STRATEGIES)
    # what each goes with, by hand: only DDP's buckets take a comm hook; stages are whole (ddp, none);
    # only fsdp shards beside --tp; hsdp alone builds its own mesh and takes --mesh
    table = {name: (s.takes_comm_hook, s.takes_stages, s.shards_beside_tp, s.own_mesh, s.takes_mesh,
                    s.accelerate_wraps) for name, s in REGISTERED.items()}
    assert table == {"ddp": (True, True, False, False, False, True), "none": (False, True, False, False, False, False),
                     "fsdp": (False, False, True, False, False, True), "hsdp": (False, False, False, True, True, False)}
    with pytest.raises(OptionsError, match=r"^unknown strategy 'zero3'; use one of: ddp, none, fsdp, hsdp$"):
        data_parallel("zero3")
    assert data_parallel("fsdp").accelerate_plugin(CellOptions(strategy="fsdp")).fsdp_version == 2
    assert data_parallel("fsdp").accelerate_plugin(CellOptions(strategy="fsdp", tp=2)) is None  # workbench shards


def test_the_fleet_refuses_before_anything_runs(fleet):
    cells = fleet.session.cells_run
    with pytest.raises(OptionsError, match="larger than the world"):
        fleet.run("1", options=CellOptions(tp=4), show_output=False)
    with pytest.raises(OptionsError, match="drop --ranks"):
        fleet.run("1", options=CellOptions(tp=2), ranks=[0], show_output=False)
    assert fleet.session.cells_run == cells, "no cell was sent"


DDP_TRAIN = """
import torch
from workbench.models import mlp, synthetic_batch
torch.manual_seed(0)
model = mlp(width=32, hidden=256, depth=2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
losses = []
for step in range(8):
    x, y = synthetic_batch(step, 16, 32, seed=rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
    losses.append(loss.item())
losses, type(model._comm_hooks[0][1]).__name__ if model._comm_hooks else None
"""


def test_comm_hooks_train_close_to_plain_ddp_and_report_communication_time(fleet):
    plain, _ = fleet.run(DDP_TRAIN, show_output=False)[0]
    for hook, state, tolerance in (("fp16", "NoneType", 1e-3), ("bf16", "NoneType", 1e-2)):
        first = len(fleet.metrics.store)
        losses, registered = fleet.run(DDP_TRAIN, options=CellOptions(comm_hook=hook), show_output=False)[0]
        assert registered == state, hook
        assert losses != plain, f"{hook}: the gradients really were compressed"
        assert losses[-1] == pytest.approx(plain[-1], rel=tolerance), hook
        assert losses[-1] < losses[0], f"{hook}: the loss goes down"
        comm = [r.system.get("comm_s", 0.0) for r in fleet.metrics.store.since(first)]
        assert sum(comm) > 0, f"{hook}: communication time still measured"


def test_powersgd_state_is_torchs_own():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from workbench.parallel.hooks import comm_hook

    state, hook = comm_hook("powersgd:3")
    assert hook is powerSGD_hook.powerSGD_hook and state.matrix_approximation_rank == 3
    assert state.start_powerSGD_iter == 2


TP_CHECK = """
import copy, torch
from workbench.models import TinyTransformer, synthetic_batch
torch.manual_seed(0)
model = TinyTransformer(dim=32, layers=2, heads=4)
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
q = model.layers[0].attn.q.weight
placement = (type(q).__name__, str(q.placements[0]), tuple(q.to_local().shape))
diffs = []
for step in range(3):
    x, y = synthetic_batch(step, 4, 32, length=8)   # the same batch on both TP ranks
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward(); ref_optimizer.step(); ref_optimizer.zero_grad()
    diffs.append(abs(loss.item() - ref_loss.item()))
full = model.layers[1].mlp.w2.weight.full_tensor()
placement, max(diffs), (full - reference.layers[1].mlp.w2.weight).abs().max().item()
"""


def test_tensor_parallel_transformer_matches_a_single_process_run(fleet):
    for got in fleet.run(TP_CHECK, options=CellOptions(tp=2), show_output=False):
        placement, loss_diff, weight_diff = got
        assert placement == ("DTensor", "S(0)", (16, 32)), "q is split by output over the 2 TP ranks"
        assert loss_diff < 1e-5 and weight_diff < 1e-5


MLP_TP_CHECK = """
import copy, torch
from workbench.models import mlp, synthetic_batch
torch.manual_seed(0)
model = mlp(width=16, hidden=64, depth=1)          # Linear, ReLU, Linear: one colwise/rowwise pair
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(3):
    x, y = synthetic_batch(step, 8, 16)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    ref = torch.nn.functional.mse_loss(reference(x), y)
    ref.backward(); ref_optimizer.step(); ref_optimizer.zero_grad()
[str(model[i].weight.placements[0]) for i in (0, 2)], abs(loss.item() - ref.item())
"""


def test_tensor_parallel_linear_pairs_of_a_sequential_match_a_single_process_run(fleet):
    for placements, loss_diff in fleet.run(MLP_TP_CHECK, options=CellOptions(tp=2), show_output=False):
        assert placements == ["S(0)", "S(1)"], "first Linear split by output, second by input"
        assert loss_diff < 1e-5


PP_CHECK = """
import copy, torch
from workbench.models import mlp, synthetic_batch
torch.manual_seed(0)
model = mlp(width=16, hidden=64, depth=2)          # 6 children: 3 per stage
reference = copy.deepcopy(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
diffs = []
for step in range(3):
    x, y = synthetic_batch(step, 8, 16)
    loss = model.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    optimizer.step(); optimizer.zero_grad()
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward(); ref_optimizer.step(); ref_optimizer.zero_grad()
    diffs.append(abs(loss.item() - ref_loss.item()))
mine = dict(model.stage.named_parameters())
weight_diff = max((p - dict(reference.named_parameters())[n]).abs().max().item() for n, p in mine.items())
sum(len(g["params"]) for g in optimizer.param_groups), sorted(mine), max(diffs), weight_diff
"""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_match_a_single_process_run(fleet, schedule):
    got = fleet.run(PP_CHECK, options=CellOptions(pp=2, microbatches=4, schedule=schedule), show_output=False)
    assert got[0][1] == ["0.bias", "0.weight", "2.bias", "2.weight"] and got[1][1] == [
        "3.bias", "3.weight", "5.bias", "5.weight"], "each rank keeps its stage under the original names"
    for params, _names, loss_diff, weight_diff in got:
        assert params == 4, "the optimizer holds this stage's parameters only"
        assert loss_diff < 1e-5 and weight_diff < 1e-5


AC_COUNT = """
import torch
from workbench.models import TinyTransformer, synthetic_batch
torch.manual_seed(0)
model = TinyTransformer(dim=32, layers=2, heads=4)
calls = []
model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x, y = synthetic_batch(0, 4, 32, length=8, seed=rank)
loss = torch.nn.functional.mse_loss(model(x), y)
accelerator.backward(loss); optimizer.step()
len(calls), round(loss.item(), 6)
"""


def test_activation_checkpointing_recomputes_blocks_in_backward(fleet):
    plain = fleet.run(AC_COUNT, show_output=False)
    checkpointed = fleet.run(AC_COUNT, options=CellOptions(activation_checkpointing=True), show_output=False)
    assert [c[0] for c in plain] == [1, 1]
    assert [c[0] for c in checkpointed] == [2, 2], "forward once, again in backward"
    assert [c[1] for c in checkpointed] == [c[1] for c in plain]
    on_fsdp = fleet.run(AC_COUNT, options=CellOptions(strategy="fsdp", activation_checkpointing=True),
                        show_output=False)
    assert [c[0] for c in on_fsdp] == [2, 2]


CKPT_SETUP = {
    "tp": ("from workbench.models import TinyTransformer\nmodel = TinyTransformer(dim=32, layers=2, heads=4)",
           "model(x)", "synthetic_batch(step, 4, 32, length=8)"),
    "pp": ("from workbench.models import mlp\nmodel = mlp(width=16, hidden=64, depth=2)",
           None, "synthetic_batch(step, 8, 16)"),
}
CKPT_TRAIN = """
for step in range(2):
    x, y = {batch}
    if {pipelined}:
        model.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    else:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step(); optimizer.zero_grad()
"""
CKPT_SNAPSHOT = """
{n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}
"""


@pytest.mark.parametrize("kind", ["tp", "pp"])
def test_tensor_and_pipeline_parallel_checkpoints_save_and_restore(fleet, kind):
    build, _, batch = CKPT_SETUP[kind]
    options = CellOptions(tp=2) if kind == "tp" else CellOptions(pp=2)
    setup = (f"import torch\nfrom workbench.models import synthetic_batch\ntorch.manual_seed(0)\n{build}\n"
             "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)\n"
             "model, optimizer = accelerator.prepare(model, optimizer)\n")
    train = CKPT_TRAIN.format(batch=batch, pipelined=kind == "pp")
    fleet.run(setup + train, options=options, show_output=False)
    saved = fleet.run(CKPT_SNAPSHOT, options=options, show_output=False)
    tag = fleet.checkpoints.save(tag=f"parallel-{kind}")
    fleet.run(train, options=options, show_output=False)  # moves away from the saved state
    moved = fleet.run(CKPT_SNAPSHOT, options=options, show_output=False)
    assert any((moved[0][k] != saved[0][k]).any() for k in saved[0])
    restored = fleet.checkpoints.restore(tag)
    assert {"model", "optimizer"} <= set(restored["restored"])
    for before, after in zip(saved, fleet.run(CKPT_SNAPSHOT, options=options, show_output=False), strict=True):
        assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
    fleet.run(train, options=options, show_output=False)  # and training goes on from there


@pytest.fixture(scope="module")
def four():
    with Fleet(n=4, progress=False, wandb=False) as f:
        yield f


MESH_TRAIN = """
import torch
from workbench.models import TinyTransformer, synthetic_batch
torch.manual_seed(0)
model = TinyTransformer(dim=32, layers=2, heads=4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
losses = []
for step in range(3):
    x, y = synthetic_batch(step, 4, 32, length=8, seed={seed})
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    mean = loss.detach().clone(); torch.distributed.all_reduce(mean); losses.append(mean.item() / world_size)
w = model.layers[0].mlp.w1.weight
losses, [str(p) for p in w.placements], tuple(w.to_local().shape), (mesh.mesh.tolist() if mesh is not None else None)
"""


def test_hsdp_shards_inside_groups_replicates_across_and_matches_fsdp(four):
    # the data parallel rank is the global rank for both: 4 different batches
    fsdp = four.run(MESH_TRAIN.format(seed="rank"), strategy="fsdp", show_output=False)
    hsdp = four.run(MESH_TRAIN.format(seed="rank"), options=CellOptions(strategy="hsdp", mesh="2x2"),
                    show_output=False)
    losses, placements, local, layout = hsdp[0]
    assert placements == ["R", "S(0)"] and local == (64, 32), "half of w1 (128 rows) per rank"
    assert layout == [[0, 1], [2, 3]], "shard groups {0,1} and {2,3}, replicated across"
    assert fsdp[0][2] == (32, 32), "FSDP on 4 ranks keeps a quarter"
    assert losses == pytest.approx(fsdp[0][0], abs=1e-5)


def test_data_times_tensor_parallel_on_four_ranks_matches_fsdp(four):
    # dp rank = rank // 2: both TP ranks of a group see the same batch
    dp_tp = four.run(MESH_TRAIN.format(seed="rank // 2"), options=CellOptions(strategy="fsdp", tp=2),
                     show_output=False)
    fsdp_pairs = four.run(MESH_TRAIN.format(seed="rank // 2"), strategy="fsdp", show_output=False)
    losses, placements, _local, layout = dp_tp[0]
    assert layout == [[0, 1], [2, 3]] and placements[1] == "S(0)" and placements[0] in ("S(0)", "_S(0, 2)")
    assert losses == pytest.approx(fsdp_pairs[0][0], abs=1e-5)
