"""Every notebook in notebooks/ runs headless in a real kernel and leaves no process behind."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest
from conftest import fleet_processes
from nbclient import NotebookClient

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "data" in out:
                parts.append(out.data.get("text/plain", ""))
    return "\n".join(parts)


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ is empty"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_headless(path, tmp_path):
    before = {p.pid for p in fleet_processes()}
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    leftover = [p for p in fleet_processes() if p.pid not in before and p.is_running()]
    assert not leftover, [p.cmdline() for p in leftover]
    text = _outputs_text(nb)
    artifacts = pathlib.Path(__file__).parent / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / f"{path.stem}.txt").write_text(text)  # what the notebook printed, to read when an assertion fails
    if path.name == "01_quickstart.ipynb":
        assert "[rank 0] epoch 0" in text and "[rank 1] epoch 4" in text
        assert "DDP   loss" in text and "FSDP  loss" in text
        assert "DTensor: local shard (64, 32) of (128, 32)" in text
    if path.name == "02_live_metrics.ipynb":
        assert re.search(r"scalar +rank +last", text) and "peak rss MiB" in text
        assert "communication per step: DDP" in text and "none 0.00 ms" in text
        assert "live in Jupyter" in text  # the dashboard's text fallback
    if path.name == "03_checkpoints.ipynb":
        assert "[rank 0] task A loss after 150 steps" in text and "[rank 1] task A loss after 150 steps" in text
        assert "restored checkpoint 'task-a' (step 150) on 2 ranks" in text
        assert "[rank 0] back at step 150" in text
        assert "on 3 ranks, resharded from 2 ranks: model, optimizer, scheduler, rng" in text
        assert "[rank 2] rank 2/3: shard (42, 32) of (128, 32), step 150" in text
        assert "task C (new data) loss" in text and "at step 250" in text
    if path.name == "04_elastic.ipynb":
        assert "[rank 1] 2 ranks, at step 60" in text
        assert "scale 2→3: done" in text and "[rank 2] 3 ranks, shard (42, 32), at step 120" in text
        # the kill is seen before the cell or during it: the same words either way
        assert re.search(r"auto-recover 1/3: rank 1 of 3 died \(engine \d+, pid \d+", text)
        assert "restored model, optimizer, rng from 'step-120' at step 120" in text
        assert "[rank 1] 3 ranks, at step 180" in text
        # a straggler (30 ms of extra work per step on rank 2) is flagged on rank 2 only, then replaced
        assert re.search(r"rank 2 is slow: its compute per step .* is [0-9.]+× the other ranks' median", text)
        assert "rank 0 is slow" not in text and "rank 1 is slow" not in text
        assert re.search(r"\n2 +\d+ +\d+ +\S+ +cpu +slow [0-9.]+×", text), "%fleet status shows it"
        # the straggler is alive: its sharded state is saved first, so the replacement loses no step
        assert re.search(r"restored model, optimizer, rng from 'recover-\d+' at step 220", text)
        assert "[rank 2] 3 ranks, at step 260" in text
        # the tuner: a table, the fastest applied to the next cell, the trained model untouched
        assert re.search(r"strategy +precision +micro-batch +accum +samples/s +peak memory +result", text)
        best = re.search(r"\n(ddp|fsdp) +no +(16|64|256) +(16|4|1) +[0-9,.]+ +[0-9,]+ MiB +ok  <- fastest", text)
        assert best, "the fastest configuration is marked"
        kind = "FSDP" if best[1] == "fsdp" else "MULTI_CPU"
        assert f"[rank 2] this cell: {kind}, accumulation {best[3]}, micro-batch {best[2]}; the trained model is " \
               "still at step 260" in text
    if path.name == "05_parallelism.ipynb":
        losses = [float(x) for x in re.findall(r"loss after 30 steps: ([0-9.]+)", text)]
        assert len(losses) == 3 and max(losses) / min(losses) < 1.1, "hooks train like plain DDP"
        assert re.search(r"rank +records +steps/s +step ms +first step ms +comm ms +samples/s", text)
        tp = re.search(r"TP: q shard \(16, 32\) of \(32, 32\); loss ([0-9.]+) vs one process ([0-9.]+)", text)
        assert tp and abs(float(tp[1]) - float(tp[2])) < 1e-5
        for stage in re.findall(r"PP stage \d: .*?loss ([0-9.]+) vs one process ([0-9.]+)", text):
            assert abs(float(stage[0]) - float(stage[1])) < 1e-5
        assert "layers ['0', '1', '2']" in text and "layers ['3', '4', '5']" in text
        assert "block forward ran 2 times in one step" in text
        assert "scale 2→4: done" in text
        assert "HSDP mesh [[0, 1], [2, 3]]: w1 ['R', 'S(0)'], local (64, 32) of (128, 32)" in text
        assert "dp x tp mesh [[0, 1], [2, 3]]: w1 local (32, 32) of (128, 32)" in text
    if path.name == "06_llm.ipynb":
        assert re.search(r"\[rank 0\] [0-9,]+ parameters in 8 FSDP units on 2 ranks", text)  # 4 layers, embed, tail x2, root
        first, last = map(float, re.search(r"\[rank 0\] loss ([0-9.]+) -> ([0-9.]+) at step 40 on 2 ranks", text).groups())
        assert last < first - 0.5, "the loss goes down"
        assert re.search(r"rank +records +steps/s .* tokens/s +MFU %", text)
        assert "scale 2→3: done" in text and "[rank 2] loss" in text and "at step 70 on 3 ranks" in text
        assert "recover: done" in text and "[rank 1] after recovery: loss" in text and "at step 100 on 3 ranks" in text
        assert "[rank 0] Trainer: 20 steps on 3 ranks, mean loss" in text
        # text progress bars (datasets.map, the Trainer's) at their last state, rank 0's only; the loss lines
        assert re.search(r"\[rank 0 stderr\] Map: 100%\|[^\n]*\|", text) and "[rank 1 stderr] Map" not in text
        assert re.search(r"\[rank 0 stderr\] 100%\|[^\n]*\| 20/20", text)
        assert len(re.findall(r"\[rank 0\] \{'loss': '[0-9.]+'", text)) == 4
