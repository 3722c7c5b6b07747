"""The torchrun side of bench_elastic: FSDP2 + AdamW, resume from a DCP checkpoint, one step.

``torchrun --nproc-per-node N elastic_resume.py CKPT_DIR save|resume OUT``: ``save`` trains
one step and writes the checkpoint; ``resume`` loads it (resharded to N ranks), trains one
step, and rank 0 writes the wall time at which that step finished.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

WIDTH = 1024


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, WIDTH))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, optimizer):
    loss = model(torch.randn(16, WIDTH)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


if __name__ == "__main__":
    folder, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    model, optimizer = build()
    if mode == "save":
        step(model, optimizer)
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step(model, optimizer)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                f.write(str(time.time()))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 sometimes aborts in a thread's destructor at interpreter exit (seen: SIGABRT)
