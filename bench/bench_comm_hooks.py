"""(g) DDP communication hooks on the same model in one run: communication time and bytes
all-reduced per step with and without each hook (``--comm-hook fp16|bf16``; PowerSGD needs
nccl, so it runs only on a GPU machine), and the loss after N steps, which should stay close
to plain DDP.

Bytes are counted on the ranks by wrapping ``torch.distributed.all_reduce`` (what
torch's hooks call); without a hook DDP's C++ reducer sends every bucket once per step, and
the bucket sizes come from DDP's own logging data. Communication time is workbench's own ``comm_s`` metric.
"""

from __future__ import annotations

import statistics

from common import report

from workbench import CellOptions, Fleet

STEPS = 40
HOOKS = [None, "fp16", "bf16"]  # powersgd is refused on gloo (torch's hook crashes ranks there)
COUNT_BYTES = """
import torch.distributed as dist
if not hasattr(dist, "_bench_bytes"):
    _all_reduce = dist.all_reduce
    dist._bench_bytes = [0]
    def _counting(tensor, *args, **kwargs):
        dist._bench_bytes[0] += tensor.numel() * tensor.element_size()
        return _all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = _counting
"""
TRAIN = """
import torch
from workbench.models import mlp, synthetic_batch
torch.manual_seed(0)
model = mlp(width=256, hidden=1024, depth=2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
dist._bench_bytes[0] = 0
for step in range({steps}):
    x, y = synthetic_batch(step, 64, 256, seed=rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
sent = dist._bench_bytes[0] / {steps}
if not sent:  # no Python hook: DDP's C++ reducer all-reduces every bucket once per step
    sent = sum(int(b) for b in model._get_ddp_logging_data()["bucket_sizes"].split(","))
mean = loss.detach().clone(); dist.all_reduce(mean)
sent, mean.item() / world_size
"""


def main() -> dict:
    rows = {}
    with Fleet(n=2, progress=False, wandb=False, hang_timeout=60) as fleet:
        fleet.run(COUNT_BYTES, show_output=False)
        for hook in HOOKS:
            print(f"comm hook {hook or 'none'}…", flush=True)
            first = len(fleet.metrics.store)
            bytes_per_step, loss = fleet.run(TRAIN.format(steps=STEPS), options=CellOptions(comm_hook=hook),
                                             show_output=False)[0]
            records = [r for r in fleet.metrics.store.since(first) if r.rank == 0 and "comm_s" in r.system]
            comm = statistics.median(r.system["comm_s"] for r in records[5:])
            step = statistics.median(r.system["step_time_s"] for r in records[5:])
            rows[hook or "plain"] = (comm, bytes_per_step, loss, step)
    plain_comm, plain_bytes, plain_loss, plain_step = rows["plain"]
    result = {"steps": STEPS}
    for name, (comm, nbytes, loss, step) in rows.items():
        result[f"{name}_comm_ms_per_step"] = comm * 1e3
        result[f"{name}_kb_allreduced_per_step"] = nbytes / 1024
        result[f"{name}_loss_after_{STEPS}_steps"] = loss
        if name != "plain":
            result[f"{name}_comm_ratio_vs_plain"] = comm / plain_comm
            result[f"{name}_bytes_ratio_vs_plain"] = nbytes / plain_bytes
            result[f"{name}_step_time_ratio_vs_plain"] = step / plain_step
            result[f"{name}_loss_rel_diff_vs_plain"] = abs(loss - plain_loss) / plain_loss
    return report("comm_hooks", result)


if __name__ == "__main__":
    main()
