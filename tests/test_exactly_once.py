"""Exactly-once training data: restart, rescale and recovery resume the same run, sample for
sample, and a same-size resume ends bit-exact with the run that was never interrupted.

Every rank writes the ids it trained on at each step to a file (a killed rank's lines stay),
tagged with the attempt; for each step only the newest attempt counts. Then, for every
completed epoch, every id must have been trained exactly once, plus the duplicates that
accelerate's ``even_batches`` adds to fill the last step of a pass: computed here by hand
from the world size of each step (:func:`expected_padding`).
"""

from __future__ import annotations

import collections
import json
import random

import pytest
import torch
from conftest import wait_until_gone

from workbench import CellOptions, DistributedCellError, Fleet, FleetError, OptionsError

N, B = 96, 4  # ids, batch per rank: an epoch is 12 steps at 2 ranks, 8 at 3, 6 at 4

SETUP = """
import json, os, torch
from torch.utils.data import DataLoader, Dataset

class Ids(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        return torch.tensor([float(i % 7) - 3, float(i % 5) - 2, (i % 11) / 11]), i

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = DataLoader(Ids(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

TRAIN = """
def train(stop, attempt, path, kill_at=None, victims=()):
    with open(path, "a") as out:
        while workbench.step < stop:
            for x, ids in loader:
                with accelerator.accumulate(model):
                    step = workbench.step
                    loss = (model(x).squeeze(1) - x[:, 0] * x[:, 1]).pow(2).mean()
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                out.write(json.dumps([attempt, step, rank, loader.iteration, ids.tolist()]) + "\\n")
                out.flush()
                if kill_at is not None and workbench.step == kill_at and rank in victims:
                    os.kill(os.getpid(), 9)
                if workbench.step >= stop:
                    break
"""

PARAMS = "[p.detach().clone() for p in model.parameters()]"


def trained_per_epoch(path: str) -> dict[int, collections.Counter]:
    """{epoch: Counter of ids}, counting for each step only its newest attempt."""
    rows = [json.loads(line) for line in open(path)]
    newest: dict[int, int] = {}
    for attempt, step, _rank, _epoch, _ids in rows:
        newest[step] = max(newest.get(step, attempt), attempt)
    epochs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for attempt, step, _rank, epoch, ids in rows:
        if attempt == newest[step]:
            epochs[epoch].update(ids)
    return epochs


def expected_padding(worlds: list[int], micro: int = 1) -> dict[int, int]:
    """{epoch: duplicated samples}: ``worlds[s]`` ranks trained step ``s``, each on ``micro``
    batches of B. A pass deals batches round-robin; its last round is filled up to one batch per
    rank from the pass's own batches (accelerate's even_batches), and that round ends the step."""
    total, padding, epoch, used = N // B, {}, 0, 0
    for world in worlds:
        for _ in range(micro):
            used += world
            if used >= total:
                padding[epoch], epoch, used = (used - total) * B, epoch + 1, 0
                break
    return padding


def assert_exactly_once(path: str, worlds: list[int], micro: int = 1) -> None:
    padding = expected_padding(worlds, micro)
    epochs = trained_per_epoch(path)
    assert set(padding) <= set(epochs)
    for epoch, extra in padding.items():
        counts = epochs[epoch]
        assert set(counts) == set(range(N)), f"epoch {epoch}: never trained {sorted(set(range(N)) - set(counts))}"
        assert sum(counts.values()) - N == extra, (f"epoch {epoch}: {sum(counts.values()) - N} samples trained "
                                                   f"twice, {extra} expected (padding)")


def assert_same_params(a, b) -> None:
    assert len(a) == len(b) and all(x.equal(y) for x, y in zip(a, b, strict=True)), "parameters differ"


def fresh_start(fleet, options: CellOptions | None = None, setup: str = SETUP) -> None:
    """The setup cells again on every rank, at step 0 (a new run on the same engines)."""
    fleet.session.forget_setup()
    fleet.execute(setup, options or CellOptions(), show_output=False, setup=True)
    fleet.execute(TRAIN, options or CellOptions(), show_output=False, setup=True)
    fleet.run("workbench.step = 0", show_output=False)


def train(fleet, stop, attempt, path, options: CellOptions | None = None, **kwargs):
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return fleet.execute(f"train({stop}, {attempt}, {path!r}{', ' if args else ''}{args})",
                         options or CellOptions(), show_output=False)


def reference(fleet, tmp_path, stop: int, options: CellOptions | None = None):
    """Parameters of an uninterrupted run of ``stop`` steps at the fleet's world size."""
    path = str(tmp_path / f"reference-{fleet.world_size}.jsonl")
    open(path, "w").close()
    fresh_start(fleet, options)
    train(fleet, stop, 0, path, options)
    assert_exactly_once(path, [fleet.world_size] * stop)
    return fleet.run(PARAMS, show_output=False)[0]


@pytest.fixture(scope="module")
def shared_fleet():
    with Fleet(n=2, progress=False, wandb=False) as f:
        yield f


@pytest.fixture
def fleet(shared_fleet):
    """The module's fleet; one a failed test left half-recovered or with a dead rank (a native
    crash of a rank) is recovered before the next test, which would otherwise fail on it."""
    yield shared_fleet
    if shared_fleet.session.unfinished is not None or shared_fleet.pool.dead_ranks(settle_s=0.5) or shared_fleet.session.fresh_ranks:
        shared_fleet.recover()


def resize(fleet, n: int) -> None:
    if fleet.world_size != n:
        fleet.scale(n)


def test_restart_in_epoch_1_resumes_the_same_order_bit_exact(fleet, tmp_path):
    resize(fleet, 2)
    ref = reference(fleet, tmp_path, 24)
    path = str(tmp_path / "restart.jsonl")
    fresh_start(fleet)
    train(fleet, 17, 0, path)  # epoch 1, 5 steps in
    fleet.run("workbench.checkpoint.save(tag='restart-17')", show_output=False)
    saved = fleet.checkpoints.list()[-1].path
    with Fleet(n=2, progress=False, wandb=False) as other:  # a new fleet: new processes, nothing kept
        fresh_start(other)
        restored = other.run(f"workbench.checkpoint.restore({saved!r})", show_output=False)[0]
        assert restored["step"] == 17 and "loader" in restored["restored"]
        train(other, 24, 1, path)
        assert_same_params(ref, other.run(PARAMS, show_output=False)[0])
    assert_exactly_once(path, [2] * 24)


@pytest.mark.parametrize("seed,generator", [(3, True), (11, True), (5, False)])
def test_rescale_mid_epoch_trains_every_sample_once(fleet, tmp_path, seed, generator):
    """2 -> 3 or 4 -> 2 ranks at seeded random steps, across an epoch boundary; with the loader's
    own generator, or none (accelerate makes one, seeded from rank 0's global RNG)."""
    resize(fleet, 2)
    rng = random.Random(seed)
    first = rng.randrange(1, 12)  # in epoch 0, at 2 ranks
    second = rng.randrange(first + 1, first + 12)
    stop = second + rng.randrange(4, 14)
    middle = rng.choice([3, 4])
    path = str(tmp_path / "rescale.jsonl")
    fresh_start(fleet, setup=SETUP if generator else SETUP.replace(", generator=torch.Generator().manual_seed(7)", ""))
    train(fleet, first, 0, path)
    fleet.scale(middle)
    assert fleet.run("workbench.step", show_output=False) == [first] * middle
    train(fleet, second, 1, path)
    fleet.scale(2)
    train(fleet, stop, 2, path)
    assert_exactly_once(path, [2] * first + [middle] * (second - first) + [2] * (stop - second))


def test_rescale_to_one_rank_and_back(fleet, tmp_path):
    """One rank has no sharded sampler (its own batches are the sequence): the rest of the epoch still
    goes on there, and is dealt out again at 2."""
    resize(fleet, 2)
    path = str(tmp_path / "one.jsonl")
    fresh_start(fleet)
    train(fleet, 3, 0, path)
    fleet.scale(1)
    train(fleet, 30, 1, path)
    fleet.scale(2)
    train(fleet, 40, 2, path)
    assert_exactly_once(path, [2] * 3 + [1] * 27 + [2] * 10)


def test_rescale_with_grad_accum_moves_at_optimizer_steps(fleet, tmp_path):
    resize(fleet, 2)
    accum = CellOptions(grad_accum=2)
    path = str(tmp_path / "accum.jsonl")
    fresh_start(fleet, accum)
    train(fleet, 4, 0, path, accum)  # 8 micro-batches per rank
    assert fleet.run("loader._workbench_position.done", show_output=False) == [8, 8]
    fleet.scale(3)
    train(fleet, 11, 1, path, accum)
    # one accumulation window of 2 micro-batches per step (each its own line with the step's number)
    assert_exactly_once(path, [2] * 4 + [3] * 7, micro=2)


@pytest.mark.parametrize("world,victims", [(2, (1,)), (3, (1,)), (4, (1, 2))])
def test_ddp_recovery_from_a_live_replica_is_exact(fleet, tmp_path, world, victims):
    """Kill one rank (two of four) in epoch 1; the survivors' live state goes on. At 3+ ranks the
    recovered DDP model's first step all-reduces with DDP's initial bucket layout (the parameters
    in definition order; later steps use the layout rebuilt from the backward order), so gloo's
    ring adds some elements' three or four terms in another order: equal to float rounding."""
    resize(fleet, world)
    steps = 2 * N // (B * world)  # two epochs
    ref = reference(fleet, tmp_path, steps)
    path = str(tmp_path / "recover.jsonl")
    fresh_start(fleet)
    kill_at = steps // 2 + 1  # in epoch 1
    pids = [fleet.member(r).pid for r in victims]
    with pytest.raises((DistributedCellError, FleetError)):
        train(fleet, steps, 0, path, kill_at=kill_at, victims=victims)
    assert not wait_until_gone(pids)
    report = fleet.recover()
    assert report["source"] is not None and report["step"] == kill_at, report  # no checkpoint: a survivor
    train(fleet, steps, 1, path)
    got = fleet.run(PARAMS, show_output=False)[0]
    if world == 2:  # a sum of two terms does not depend on their order
        assert_same_params(ref, got)
    else:
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref, got, strict=True))
    assert_exactly_once(path, [world] * steps)


FULL_PARAMS = "[(p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone() for p in model.parameters()]"


@pytest.mark.parametrize("victims,live", [((1,), True), ((1, 2), True), ((0, 1), True), ((0, 2), False)])
def test_hsdp_recovery_takes_each_lost_shard_from_its_replica(fleet, tmp_path, victims, live):
    """hsdp on 2x2 (shard groups {0,1} and {2,3}): rank r's shard has a replica in rank r±2. Lost
    ranks whose shards survive elsewhere come back from those live replicas, bit-exact with the
    run that was never interrupted; when both copies of a shard are lost (0 and 2), only a
    checkpoint has it (here the one the scale to 4 ranks saved)."""
    resize(fleet, 4)
    try:
        _recover_hsdp(fleet, tmp_path, victims, live)
    finally:
        fleet.session.forget_setup()  # the next test's resize must not replay a 2x2 mesh


def _recover_hsdp(fleet, tmp_path, victims, live):
    hsdp = CellOptions(strategy="hsdp", mesh="2x2")
    steps = 2 * N // (B * 4)
    reference(fleet, tmp_path, steps, hsdp)
    ref = fleet.run(FULL_PARAMS, options=hsdp, show_output=False)[0]
    path = str(tmp_path / "hsdp.jsonl")
    fresh_start(fleet, hsdp)
    kill_at = steps // 2 + 1
    pids = [fleet.member(r).pid for r in victims]
    with pytest.raises((DistributedCellError, FleetError)):
        train(fleet, steps, 0, path, hsdp, kill_at=kill_at, victims=victims)
    assert not wait_until_gone(pids)
    report = fleet.recover()
    if not live:
        assert report["source"] is None and report["checkpoint"] is not None, report
        return
    assert report["step"] == kill_at and report["checkpoint"] is None, report
    assert len(report["sources"]) == 2 and not set(report["sources"]) & set(victims), report  # one per shard
    train(fleet, steps, 1, path, hsdp)
    assert_same_params(ref, fleet.run(FULL_PARAMS, options=hsdp, show_output=False)[0])
    assert_exactly_once(path, [4] * steps)


def test_recover_shrink_deals_the_rest_of_the_epoch_over_the_survivors(fleet, tmp_path):
    resize(fleet, 3)
    path = str(tmp_path / "shrink.jsonl")
    fresh_start(fleet)
    pid = fleet.member(2).pid
    with pytest.raises((DistributedCellError, FleetError)):
        train(fleet, 30, 0, path, kill_at=5, victims=(2,))
    assert not wait_until_gone([pid])
    report = fleet.recover(shrink=True)
    assert fleet.world_size == 2 and report["source"] is not None and report["step"] == 5
    train(fleet, 20, 1, path)
    assert_exactly_once(path, [3] * 5 + [2] * 15)


def test_auto_recover_reruns_the_cell_from_the_live_state(fleet, tmp_path):
    resize(fleet, 3)
    path = str(tmp_path / "auto.jsonl")
    fresh_start(fleet)
    fleet.options.auto_recover, fleet.session.restarts = True, 0
    try:
        # run again after the recovery, the cell goes on from step 5: no rank is at step 5 after a step
        train(fleet, 10, 0, path, kill_at=5, victims=(2,))
    finally:
        fleet.options.auto_recover = False
    assert fleet.session.restarts == 1
    assert fleet.run("workbench.step", show_output=False) == [10] * 3
    assert_exactly_once(path, [3] * 10)


def test_fsdp_recovery_from_the_checkpoint_retrains_only_what_was_lost(fleet, tmp_path):
    resize(fleet, 2)
    fsdp = CellOptions(strategy="fsdp")
    path = str(tmp_path / "fsdp.jsonl")
    fresh_start(fleet, fsdp)
    train(fleet, 8, 0, path, fsdp)
    fleet.run("workbench.checkpoint.save(tag='fsdp-8')", strategy="fsdp", show_output=False)
    pid = fleet.member(1).pid
    with pytest.raises((DistributedCellError, FleetError)):
        train(fleet, 24, 1, path, fsdp, kill_at=11, victims=(1,))
    assert not wait_until_gone([pid])
    report = fleet.recover()
    assert report["checkpoint"] == "fsdp-8" and report["step"] == 8
    train(fleet, 24, 2, path, fsdp)
    assert_exactly_once(path, [2] * 24)


def test_recover_on_a_healthy_ddp_fleet_keeps_the_live_state(fleet, tmp_path):
    resize(fleet, 3)
    path = str(tmp_path / "healthy.jsonl")
    fresh_start(fleet)
    train(fleet, 5, 0, path)
    before = fleet.run(PARAMS, show_output=False)[0]
    report = fleet.recover()
    assert report["source"] is not None and report["step"] == 5
    assert_same_params(before, fleet.run(PARAMS, show_output=False)[0])
    train(fleet, 12, 1, path)
    assert_exactly_once(path, [3] * 12)


ITERABLE = """
import torch, datasets
stream = datasets.Dataset.from_dict({"id": list(range(96))}).to_iterable_dataset(num_shards=4)
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(stream.with_format("torch"), batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

def take(k):
    seen = []
    for batch in loader:
        accelerator.backward(model(batch["id"].float()[:, None]).sum()); optimizer.step(); optimizer.zero_grad()
        seen.append(batch["id"].tolist())
        if len(seen) == k:
            break
    return seen
"""


def test_iterable_dataset_resumes_exactly_and_refuses_what_cannot_move(fleet):
    """An HF IterableDataset, dispatched by accelerate (rank 0 reads, every rank gets its part)."""
    resize(fleet, 2)
    none = CellOptions(strategy="none")
    fleet.session.forget_setup()
    fleet.execute(ITERABLE, none, show_output=False, setup=True)
    fleet.run("workbench.step = 0", strategy="none", show_output=False)
    first = fleet.run("take(5)", strategy="none", show_output=False)
    assert fleet.run("loader._workbench_position.kind", strategy="none", show_output=False) == ["stream"] * 2
    fleet.run("workbench.checkpoint.save(tag='stream-5')", strategy="none", show_output=False)
    rest = fleet.run("take(7)", strategy="none", show_output=False)
    ids = sorted(i for batches in first + rest for batch in batches for i in batch)
    assert ids == list(range(N)), "one epoch over both ranks, every id once"
    fleet.execute(ITERABLE, none, show_output=False)  # a fresh loader, at the start of the stream
    fleet.run("workbench.checkpoint.restore('stream-5')", strategy="none", show_output=False)
    assert fleet.run("take(7)", strategy="none", show_output=False) == rest  # same ranks, same batches
    fleet.run("workbench.checkpoint.restore('stream-5')", strategy="none", show_output=False)
    # 5 rounds of 2 batches used: 10 batches of the stream do not divide over 3 ranks
    with pytest.raises(OptionsError, match="dataloader 'loader' has used 10 batches .* not divide over 3 ranks"):
        fleet.scale(3)
    assert fleet.world_size == 2 and fleet.run("workbench.step", strategy="none", show_output=False) == [5, 5]
    fleet.scale(1)  # 10 batches divide over 1 rank: it reads the rest of the stream in order
    fleet.run("workbench.checkpoint.restore('stream-5')", strategy="none", show_output=False)
    in_order = [batch for pair in zip(rest[0], rest[1], strict=True) for batch in pair]
    assert fleet.run("take(14)", strategy="none", show_output=False)[0] == in_order
    fleet.scale(2)


def test_an_iterable_each_rank_reads_its_own_part_of_resumes_at_its_size_only(fleet):
    """An HF IterableDataset that accelerate shards (dispatch_batches=False: each rank reads its own
    files): exact at the same world size; another size is refused before anything changes."""
    resize(fleet, 2)
    none = CellOptions(strategy="none")
    sharded = ITERABLE.replace("model, optimizer, loader = accelerator.prepare(",
                               "accelerator.dataloader_config.dispatch_batches = False\n"
                               "model, optimizer, loader = accelerator.prepare(")
    fleet.session.forget_setup()
    fleet.execute(sharded, none, show_output=False, setup=True)
    fleet.run("workbench.step = 0", strategy="none", show_output=False)
    first = fleet.run("take(4)", strategy="none", show_output=False)
    assert fleet.run("(loader._workbench_position.kind, loader._workbench_position.dealt)", strategy="none",
                     show_output=False) == [("stream", False)] * 2
    fleet.run("workbench.checkpoint.save(tag='own-4')", strategy="none", show_output=False)
    rest = fleet.run("take(2)", strategy="none", show_output=False)
    fleet.execute(sharded, none, show_output=False)
    fleet.run("workbench.checkpoint.restore('own-4')", strategy="none", show_output=False)
    assert fleet.run("take(2)", strategy="none", show_output=False) == rest
    assert first[0] != first[1]
    fleet.run("workbench.checkpoint.restore('own-4')", strategy="none", show_output=False)
    with pytest.raises(OptionsError, match="each rank reads its own part of.* only at 2 ranks"):
        fleet.scale(3)
    assert fleet.world_size == 2


def test_step_counts_optimizer_steps_only(fleet):
    resize(fleet, 2)
    fresh_start(fleet)
    fleet.run("""
for x, ids in loader:
    accelerator.backward(model(x).pow(2).mean()); optimizer.step(); optimizer.zero_grad()
    if workbench.step == 5:
        break
seen_inside = workbench.step
""", show_output=False)
    assert fleet.run("seen_inside", show_output=False) == [5, 5]  # no workbench.log: no lag
    fleet.run("workbench.checkpoint.save(tag='sgd-5')", show_output=False)
    fleet.run("workbench.checkpoint.save(tag='sgd-5b')", show_output=False)
    assert fleet.run("workbench.step", show_output=False) == [5, 5]  # DCP's dummy step is not counted
    fleet.run("workbench.checkpoint.restore('sgd-5')", show_output=False)
    assert fleet.run("workbench.step", show_output=False) == [5, 5]


def test_registered_dict_list_and_per_rank_objects_restore(fleet):
    resize(fleet, 2)
    fleet.run("""
history = {"best": 1.5, "seen": [1, 2]}
notes = [3, 4]
class Mine:
    def __init__(self): self.value = rank * 10
    def state_dict(self): return {"value": self.value}
    def load_state_dict(self, state): self.value = state["value"]
mine = Mine()
workbench.checkpoint.register("history", history)
workbench.checkpoint.register("notes", notes)
workbench.checkpoint.register("mine", mine, per_rank=True)
workbench.checkpoint.save(tag="registered")
history["best"] = 0.1; notes.append(5); mine.value = -1
workbench.checkpoint.restore("registered")
""", show_output=False)
    assert fleet.run("history, notes, mine.value", show_output=False) == [
        ({"best": 1.5, "seen": [1, 2]}, [3, 4], 0), ({"best": 1.5, "seen": [1, 2]}, [3, 4], 10)]
    with pytest.raises(OptionsError, match="registered object 'mine' is per rank"):
        fleet.scale(3)
    assert fleet.world_size == 2
    fleet.run("from workbench.checkpoint.state import REGISTERED; REGISTERED.clear()", show_output=False)


def test_registered_stateful_dataloader_is_per_rank(fleet):
    """torchdata's StatefulDataLoader, as torchrun code uses it (a DistributedSampler, not prepared):
    every rank keeps its own loader state; it restores at the same size and refuses another."""
    resize(fleet, 2)
    fleet.run("""
import torch
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
data = list(range(96))
sdl = StatefulDataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=5))
workbench.checkpoint.register("sdl", sdl)
batches = iter(sdl)
head = [next(batches).tolist() for _ in range(3)]
workbench.checkpoint.save(tag="sdl-3")
after = [next(batches).tolist() for _ in range(2)]
""", show_output=False)
    fleet.run("sdl = StatefulDataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=5))\n"
              "workbench.checkpoint.register('sdl', sdl)\nworkbench.checkpoint.restore('sdl-3')", show_output=False)
    again = fleet.run("batches = iter(sdl); [next(batches).tolist() for _ in range(2)]", show_output=False)
    assert again == fleet.run("after", show_output=False) and again[0] != again[1]
    with pytest.raises(OptionsError, match="registered object 'sdl' is per rank"):
        fleet.scale(3)
    fleet.run("from workbench.checkpoint.state import REGISTERED; REGISTERED.clear()", show_output=False)
