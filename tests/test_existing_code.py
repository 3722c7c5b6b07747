"""Code written for torchrun, Lightning and Hugging Face runs unchanged on the fleet (issue 35).

Each script is run twice: under ``torchrun --nproc-per-node 2`` and with ``%run`` on the shared
2-rank fleet; the numbers (bit for bit), the printed lines and the exit codes must agree. The
scripts are written in the style of public examples (pytorch/examples' ddp-tutorial-series,
Lightning's Fabric and Trainer quick starts, transformers' ``test_trainer_distributed.py``): their
own argparse, ``init_process_group``, ``DistributedSampler``, ``destroy_process_group`` and
``exit(1)``; nothing of workbench in them. Lightning, transformers and datasets are the libraries'
own code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from workbench import Fleet, FleetError
from workbench.kernel.execution import DistributedCellError

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier

# pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py, as a CPU user runs it
# (gloo instead of nccl, no device ids) with a seed so that both runs see the same data
DDP_TUTORIAL = '''
import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.rank = int(os.environ["LOCAL_RANK"])
        self.model, self.train_data, self.optimizer = model, train_data, optimizer
        self.save_every, self.epochs_run = save_every, 0
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}")
        self.model = DDP(self.model)

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            F.mse_loss(self.model(source), targets).backward()
            self.optimizer.step()
        print(f"[CPU{self.rank}] Epoch {epoch} | Steps: {len(self.train_data)}")

    def train(self, max_epochs, snapshot_path):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, snapshot_path)
                print(f"Epoch {epoch} | Training snapshot saved at {snapshot_path}")


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, save_every, snapshot_path).train(total_epochs, snapshot_path)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--exit-code", default=0, type=int)
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
    if args.exit_code:
        exit(args.exit_code)
'''

FABRIC = '''
import lightning as L
import torch

fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
fabric.seed_everything(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
total = sum(p.detach().double().sum().item() for p in model.parameters())
fabric.print(f"FABRIC world {fabric.world_size} loss {loss.item():.10f} params {total!r}")
'''

LIGHTNING_TRAINER = '''
import lightning as L
import torch


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    L.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    total = sum(p.detach().double().sum().item() for p in module.parameters())
    if trainer.global_rank == 0:
        print(f"TRAINER world {trainer.world_size} params {total!r}")
'''

# transformers tests/trainer/test_trainer_distributed.py: every rank evaluates its share, the
# gathered predictions must be the dataset in order; a wrong result exits 1
HF_DISTRIBUTED_EVAL = '''
import sys

import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments


class DummyDataset(torch.utils.data.Dataset):
    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return i


class DummyDataCollator:
    def __call__(self, features):
        return {"input_ids": torch.tensor(features), "labels": torch.tensor(features)}


class DummyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(120, 80)  # unused: a model needs parameters

    def forward(self, input_ids, labels=None):
        return (torch.tensor(0.0), input_ids) if labels is not None else input_ids


if __name__ == "__main__":
    parser = HfArgumentParser((TrainingArguments,))
    sys.argv += ["--output_dir", "./hf-out", "--report_to", "none", "--use_cpu", "true"]
    training_args, rest = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    shift = int(rest[rest.index("--shift") + 1]) if "--shift" in rest else 0
    for length in [101, 40, 7]:
        dataset = DummyDataset(length)

        def compute_metrics(p):
            sequential = list(range(len(dataset)))
            success = p.predictions.tolist() == [i + shift for i in sequential]
            return {"success": success}

        trainer = Trainer(model=DummyModel(), args=training_args, data_collator=DummyDataCollator(),
                          eval_dataset=dataset, compute_metrics=compute_metrics)
        metrics = trainer.evaluate()
        if metrics["eval_success"] is not True:
            print(f"wrong predictions for {length} samples")
            exit(1)
    print(f"evaluated on {training_args.world_size} ranks: ok")
'''


def _torchrun(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    """The reference: ``script`` under plain torchrun (2 ranks). Run again once if a rank was killed by a
    signal: seen once in CI, rank 0 of transformers' eval script under plain torchrun (no workbench in
    it) ended by SIGABRT, and 7 reruns here passed. The reference is not what these tests judge."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               script, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if "(SIGABRT)" not in done.stderr and "(SIGSEGV)" not in done.stderr:
            return done
        print(f"torchrun reference died by a signal, run again:\n{done.stderr[-1500:]}")
    return done


def _write(folder, name: str, text: str) -> str:
    (folder / name).write_text(textwrap.dedent(text))
    return name


def _run_in(fleet, folder, line: str, capsys) -> str:
    """``line`` (a ``%run``) in a cell on every rank, in ``folder``; returns what the ranks printed."""
    fleet.run(f"import os\n_before = os.getcwd()\nos.chdir({str(folder)!r})")
    try:
        capsys.readouterr()
        fleet.run(line)
        return capsys.readouterr().out
    finally:
        fleet.run("os.chdir(_before)")


def _snapshot(path):
    import torch

    return torch.load(path)["MODEL_STATE"]


def test_the_ddp_tutorial_script_runs_with_percent_run_as_under_torchrun(fleet, tmp_path, capsys):
    reference, here = tmp_path / "torchrun", tmp_path / "fleet"
    reference.mkdir(), here.mkdir()
    script = _write(reference, "multigpu_torchrun.py", DDP_TUTORIAL)
    _write(here, script, DDP_TUTORIAL)
    done = _torchrun(reference, script, "3", "1")
    assert done.returncode == 0, done.stderr[-2000:]

    printed = _run_in(fleet, here, f"%run {script} 3 1", capsys)
    for line in ("[CPU0] Epoch 2 | Steps: 4", "[CPU1] Epoch 2 | Steps: 4", "Epoch 2 | Training snapshot saved at"):
        assert line in done.stdout and line in printed
    got, want = _snapshot(here / "snapshot.pt"), _snapshot(reference / "snapshot.pt")
    assert all(got[k].equal(want[k]) for k in want), "the fleet's weights are torchrun's, bit for bit"

    # resume from its own snapshot, then fail with its own exit code: the cell fails as the workers do
    done = _torchrun(reference, script, "5", "1", "--exit-code", "3")
    assert done.returncode != 0 and "exitcode  : 3" in done.stderr
    with pytest.raises(DistributedCellError, match=r"^rank 0,1 of 2 exited with code 3$"):
        _run_in(fleet, here, f"%run {script} 5 1 --exit-code 3", capsys)
    assert "Resuming training from snapshot at Epoch 3" in capsys.readouterr().out + done.stdout
    got, want = _snapshot(here / "snapshot.pt"), _snapshot(reference / "snapshot.pt")
    assert all(got[k].equal(want[k]) for k in want)
    assert fleet.run("import torch.distributed as dist\ndist.get_world_size()") == [2, 2], \
        "the script's destroy_process_group left a working group for the next cell"


def test_lightning_fabric_and_trainer_join_the_fleet_as_under_torchrun(tmp_path, capsys):
    """On a fleet of their own: Lightning asks mpi4py (where it is installed) whether MPI launched it,
    and OpenMPI's singleton start leaves a listening socket in the engine, as under torchrun."""
    reference, here = tmp_path / "torchrun", tmp_path / "fleet"
    reference.mkdir(), here.mkdir()
    with Fleet(n=2, progress=False, wandb=False, tensorboard=False) as fleet:
        for name, text, marker in (("fabric.py", FABRIC, "FABRIC world 2"),
                                   ("trainer.py", LIGHTNING_TRAINER, "TRAINER world 2")):
            _write(reference, name, text)
            _write(here, name, text)
            done = _torchrun(reference, name)
            assert done.returncode == 0, done.stderr[-2000:]
            want = re.search(rf"{marker} .*", done.stdout)[0]
            printed = _run_in(fleet, here, f"%run {name}", capsys)
            assert f"[rank 0] {want}" in printed, (want, printed[-2000:])


def test_transformers_distributed_eval_script_passes_and_its_failure_fails_the_cell(fleet, tmp_path, capsys):
    script = _write(tmp_path, "test_trainer_distributed.py", HF_DISTRIBUTED_EVAL)
    done = _torchrun(tmp_path, script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "evaluated on 2 ranks: ok" in done.stdout
    assert "[rank 0] evaluated on 2 ranks: ok" in _run_in(fleet, tmp_path, f"%run {script}", capsys)

    failed = _torchrun(tmp_path, script, "--shift", "1")
    assert failed.returncode != 0 and "exitcode  : 1" in failed.stderr
    with pytest.raises(DistributedCellError, match=r"^rank 0,1 of 2 exited with code 1$"):
        _run_in(fleet, tmp_path, f"%run {script} --shift 1", capsys)


@pytest.mark.parametrize("exit_call, code", [("exit(4)", "4"), ("quit(5)", "5"), ("sys.exit(3)", "3"),
                                             ("sys.exit('bad input')", "1 (bad input)")])
def test_an_exit_on_one_rank_ends_its_part_of_the_cell_with_the_code(fleet, exit_call, code, capsys):
    with pytest.raises(DistributedCellError) as failed:
        fleet.run(f"import sys\nif rank == 1:\n    {exit_call}\nprint('went on', rank)")
    assert str(failed.value) == f"rank 1 of 2 exited with code {code}"
    assert "[rank 0] went on 0" in capsys.readouterr().out
    assert "[rank 1] went on 1" not in capsys.readouterr().out
    assert fleet.run("rank") == [0, 1], "the engine lives on and the next cell runs"


def test_exit_without_a_code_ends_the_rank_as_a_success(fleet, capsys):
    assert fleet.run("if rank == 1:\n    exit()\n'went on'") == ["went on", None]
    assert fleet.run("import sys\nif rank == 0:\n    sys.exit(0)\n'went on'") == [None, "went on"]


def test_a_scripts_init_process_group_joins_or_refuses_in_one_line(fleet, capsys):
    fleet.run("from workbench.rank_state import STATE\nSTATE.joined_notice_sent = False  # as on a new engine")
    fleet.run("import torch.distributed as dist\ndist.init_process_group(backend='gloo', init_method='env://')")
    assert "init_process_group joined the fleet's process group" in capsys.readouterr().err
    with pytest.raises(DistributedCellError, match=r"init_process_group\(backend 'nccl'\) does not match this "
                                                   r"fleet's process group \(gloo, 2 ranks\)"):
        fleet.run("dist.init_process_group('nccl')")
    with pytest.raises(DistributedCellError, match=r"init_process_group\(world_size=3\) does not match"):
        fleet.run("dist.init_process_group('gloo', world_size=3)")
    assert fleet.run("dist.get_world_size()") == [2, 2]


def test_percent_run_refuses_ipython_options_and_missing_scripts_in_one_line(fleet):
    with pytest.raises(DistributedCellError, match=r"IPython's own %run options \(-i, -t, -d, \.\.\.\) do not apply"):
        fleet.run("%run -i nothing.py")
    with pytest.raises(DistributedCellError, match=r"%run: no script 'no-such-script.py' on this rank"):
        fleet.run("%run no-such-script.py 1 2")


def test_ranks_look_like_batch_processes_to_libraries(fleet):
    got = fleet.run("import sys, tqdm.auto\nfrom transformers.utils import is_in_notebook\n"
                    "from rich.console import Console\n"
                    "(hasattr(sys, 'ps1'), tqdm.auto.tqdm.__mro__[1].__module__, is_in_notebook(), "
                    "Console().is_jupyter)")
    assert got == [(False, "tqdm.std", False, False)] * 2


def test_progress_bars_show_their_last_state_and_other_ranks_bars_only_when_asked(fleet, capsys):
    code = ("from tqdm.auto import tqdm\nimport time\nfor _ in tqdm(range(30), desc=f'bar{rank}', mininterval=0):\n"
            "    time.sleep(0.002)\nprint('after the bar', rank)")
    fleet.run(code)
    err = capsys.readouterr().err
    assert re.search(r"\[rank 0 stderr\] bar0: 100%\|[^\n]*\| 30/30", err), err
    assert err.count("bar0:") == 1, "one line: the bar's newest state"
    assert "bar1" not in err
    fleet.execute(code, fleet.cell_defaults, show_all_progress=True)
    err = capsys.readouterr().err
    assert err.count("bar0: 100%") == 1 and err.count("bar1: 100%") == 1
    logs = open(os.path.join(fleet.rank_logs.folder, "rank-1.log")).read()
    assert "bar1: 100%" in logs and "\r" not in logs and "\u2060" not in logs, "rank 1's bars are in its log"


def test_os_exit_on_a_rank_is_its_exit_code_and_a_fresh_engine_takes_its_place():
    with Fleet(n=2, progress=False, wandb=False, tensorboard=False) as fleet:
        fleet.run("x = 41", show_output=False)
        with pytest.raises(DistributedCellError, match=r"^rank 1 of 2 exited with code 5 \(engine \d+, pid \d+\); the other"):
            fleet.run("import os\nif rank == 1:\n    os._exit(5)\nimport time\ntime.sleep(1)", show_output=False)
        with pytest.raises(FleetError, match="rank 1 was replaced by a fresh engine .*run %fleet recover first"):
            fleet.run("x", show_output=False)
        fleet.recover()
        assert fleet.run("rank", show_output=False) == [0, 1], "the next cell runs after the recovery"
