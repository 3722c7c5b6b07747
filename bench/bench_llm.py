"""The same Hugging Face training script (bench/llm_train.py: a small Llama, its own
Accelerator) under ``torchrun --nproc-per-node 2`` and on a 2-rank fleet (``--strategy none``:
the script wraps its model itself, as under torchrun).

Reports: the loss of both after the same steps (target: equal within 1e-5 relative), the
step-time ratio (target <= 1.02), tokens/s of both; and FSDP2's parameter memory at its peak
during a forward (this rank's shards + what is all-gathered at once) per block, as one unit,
against DDP's full copy.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from common import median, quiet_env, report

from workbench import CellOptions, Fleet

HERE = pathlib.Path(__file__).parent
STEPS, WARMUP, ROUNDS = 30, 5, 2
IMPORT = f"import sys; sys.path.insert(0, {str(HERE)!r})\n"

MEMORY = IMPORT + """
import torch
from llm_train import build
from workbench.parallel import UnshardedPeak, fsdp_unit_count
_tok, dataset, model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)
batch = dataset[:8]
with UnshardedPeak(model) as peak:
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
            for p in model.parameters())
(fsdp_unit_count(model), local + peak.bytes, peak.full_bytes or local)
"""


def torchrun_run() -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**quiet_env(), "ACCELERATE_USE_CPU": "True"}  # what `accelerate launch --cpu` exports
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(HERE / "llm_train.py"), "loop", str(STEPS), out.name],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.load(open(out.name))


def main() -> dict:
    ours, theirs = [], []
    with Fleet(n=2, progress=False, wandb=False) as fleet:
        for _ in range(ROUNDS):
            theirs.append(torchrun_run())
            ours.append(fleet.run(IMPORT + f"from llm_train import train_loop\ntrain_loop({STEPS})",
                                  strategy="none", show_output=False)[0])
        memory = {wrap: fleet.run(MEMORY, options=CellOptions(strategy="fsdp", fsdp_wrap=wrap), show_output=False)[0]
                  for wrap in ("auto", "none")}
        ddp = fleet.run(MEMORY, strategy="ddp", show_output=False)[0]
    loss_diff = max(abs(a - b) / abs(b) for run_a, run_b in zip(ours, theirs, strict=True)
                    for a, b in zip(run_a["losses"], run_b["losses"], strict=True))
    step_ours = median([t for run in ours for t in run["step_times"][WARMUP:]])
    step_theirs = median([t for run in theirs for t in run["step_times"][WARMUP:]])
    return report("llm", {
        "final_loss_fleet": ours[-1]["losses"][-1],
        "final_loss_torchrun": theirs[-1]["losses"][-1],
        "max_relative_loss_difference": loss_diff,
        "target_loss": "<= 1e-5",
        "step_median_fleet_s": step_ours,
        "step_median_torchrun_s": step_theirs,
        "ratio_step_fleet_over_torchrun": step_ours / step_theirs,
        "target_step": "<= 1.02",
        "tokens_per_s_fleet": median([run["tokens_per_s"] for run in ours]),
        "tokens_per_s_torchrun": median([run["tokens_per_s"] for run in theirs]),
        "fsdp_units_per_block": memory["auto"][0],
        "fsdp_units_one": memory["none"][0],
        "param_peak_mib_fsdp_per_block": memory["auto"][1] / 2**20,
        "param_peak_mib_fsdp_one_unit": memory["none"][1] / 2**20,
        "param_mib_ddp": ddp[2] / 2**20,
        "ratio_param_peak_per_block_over_ddp": memory["auto"][1] / ddp[2],
        "ratio_param_peak_one_unit_over_ddp": memory["none"][1] / ddp[2],
        "steps_each": STEPS, "rounds": ROUNDS,
    })


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
