"""``%fleet export``: a notebook's --setup cells and training cell as a script, run under
torchrun and accelerate launch, ending at the notebook's losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from workbench.kernel.export import sbatch_text

SETUP = """%%distributed --setup
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
"""

TRAIN = """%%distributed
g = torch.Generator().manual_seed(100 + rank)
for i in range(8):
    x = torch.randn(8, 16, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    workbench.log(loss=loss.item())
print(f"rank {rank} of {world_size} final loss {loss.item():.8f}")
"""

FINAL = re.compile(r"rank (\d) of 2 final loss ([0-9.]+)")


def _finals(text: str) -> dict[str, str]:
    return dict(FINAL.findall(text))


def _launch(argv: list[str], cwd, runs) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(runs), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_exported_script_runs_under_torchrun_and_accelerate_launch_to_the_notebook_losses(kernel, tmp_path):
    assert kernel.execute("%fleet start -n 2")[0]["status"] == "ok"
    for cell in (SETUP, TRAIN):
        reply, messages = kernel.execute(cell)
        assert reply["status"] == "ok", kernel.text(messages)
    notebook = _finals(kernel.text(messages))
    assert set(notebook) == {"0", "1"}, kernel.text(messages)
    kernel.execute("%%distributed --ranks 0\nlooked = True")  # a cell on some ranks is not the training cell
    script = tmp_path / "train.py"
    reply, messages = kernel.execute(f"%fleet export {script}")
    assert reply["status"] == "ok" and f"wrote {script}" in kernel.text(messages), kernel.text(messages)
    text = script.read_text()
    assert "looked" not in text and text.count("globals().update(script.cell(") == 2
    reply, messages = kernel.execute(f"%fleet export {script}")
    assert reply["status"] == "error" and "pass --force" in kernel.text(messages)

    torchrun = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                       tmp_path, tmp_path / "runs-torchrun")
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert _finals(torchrun.stdout) == notebook, torchrun.stdout[-2000:]
    (run,) = os.listdir(tmp_path / "runs-torchrun")
    with open(tmp_path / "runs-torchrun" / run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    losses = [r for r in records if "loss" in r.get("scalars", {})]
    assert sorted({r["rank"] for r in losses}) == [0, 1] and len(losses) == 16
    assert "metrics · run" in torchrun.stdout  # rank 0's summary, as under a notebook cell

    accelerate = _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                          "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(script)], tmp_path, tmp_path / "runs-accelerate")
    assert accelerate.returncode == 0, accelerate.stderr[-3000:]
    assert _finals(accelerate.stdout) == notebook, accelerate.stdout[-2000:]


def test_nothing_to_export_and_bad_names_are_one_line(tmp_path):
    from workbench.errors import FleetError
    from workbench.kernel.export import export

    with pytest.raises(FleetError, match="nothing to export yet"):
        export(str(tmp_path / "t.py"), [], None, world_size=2, nodes=1, run_id=None)
    with pytest.raises(FleetError, match="ending in .py"):
        export(str(tmp_path / "t.sh"), [("x = 1", None)], None, world_size=2, nodes=1, run_id=None)


def test_sbatch_file_runs_torchrun_on_every_node_with_the_fleets_slurm_options(tmp_path):
    text = sbatch_text("train.py", 8, 2, {"queue": "debug", "timelimit": "00:30:00", "account": "ml"}, gpus=True)
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=debug", "#SBATCH --time=00:30:00",
                 "#SBATCH --account=ml", "#SBATCH --gpus-per-node=4", "--nproc-per-node 4"):
        assert line in text, text
    (tmp_path / "train.sbatch").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "train.sbatch")]).returncode == 0
