"""accelerate's distributed utilities, exercised by user-style code that builds its own
``Accelerator()``: run under torchrun (``torchrun --nproc-per-node 2 accelerate_probe.py OUT``,
with ``ACCELERATE_USE_CPU=True`` as ``accelerate launch --cpu`` exports) and inside a fleet cell
(``probe(folder)``), the answers must be the same."""

from __future__ import annotations

import json
import os
import sys
import time


def probe(folder: str) -> dict:
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import broadcast, pad_across_processes

    accelerator = Accelerator(gradient_accumulation_steps=2)
    state = PartialState()  # after the Accelerator: on CPU a bare PartialState() ignores ACCELERATE_USE_CPU
    rank = accelerator.process_index
    out = {
        "distributed_type": str(state.distributed_type),
        "num_processes": accelerator.num_processes,
        "process_index": rank,
        "is_main_process": accelerator.is_main_process,
        "local_process_index": accelerator.local_process_index,
        "use_distributed": accelerator.use_distributed,
    }
    mine = torch.tensor([rank + 1.0])
    out["gather"] = accelerator.gather(mine).tolist()
    out["reduce_sum"] = accelerator.reduce(mine, "sum").tolist()
    out["reduce_mean"] = accelerator.reduce(mine.clone(), "mean").tolist()
    out["broadcast_from_1"] = broadcast(torch.tensor([rank * 10.0]), from_process=1).tolist()
    out["pad_across_processes"] = pad_across_processes(torch.ones(rank + 1)).tolist()
    out["gather_object"] = accelerator.gather_for_metrics([f"r{rank}"], use_gather_object=True)

    marker = os.path.join(folder, "main-was-first")
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            time.sleep(0.5)  # a rank that does not wait would look before the file exists
            open(marker, "w").close()
        out["main_process_first_saw_marker"] = os.path.exists(marker)
    accelerator.wait_for_everyone()

    with accelerator.split_between_processes(list(range(5))) as part:
        out["split_between_processes"] = list(part)

    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    out["dataloader_batches"] = [b.tolist() for b in accelerator.prepare(loader)]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    syncs = []
    for micro in range(4):
        x = torch.full((2, 4), float(rank + micro + 1))
        with accelerator.accumulate(model):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        total = 0.0
        for p in model.parameters():
            total += float((p.full_tensor() if hasattr(p, "full_tensor") else p).sum())
    out["accumulate_sync_flags"] = syncs
    out["parameter_sum_after_accumulation"] = round(total, 5)
    accelerator.wait_for_everyone()
    return out


if __name__ == "__main__":
    result = probe(sys.argv[1])
    with open(os.path.join(sys.argv[1], f"rank{result['process_index']}.json"), "w") as f:
        json.dump(result, f)
