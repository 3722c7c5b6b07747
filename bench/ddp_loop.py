"""The DDP training loop that bench_step_time runs both ways: under torchrun and in a fleet.

As a script (torchrun): ``python -m torch.distributed.run --nproc-per-node 2 ddp_loop.py STEPS OUT [WIDTH]``
writes rank 0's ``[seconds, cpu_seconds]`` of each step to OUT.
"""

from __future__ import annotations

import json
import sys
import time


def loop(accelerator, steps: int, width: int = 1024, batch: int = 64, log: bool = False,
         plain: bool = False, cpu: bool = False):
    """Train an MLP for ``steps`` steps with accelerate's DDP; return each step's seconds.

    ``log``: call ``workbench.log(loss=...)`` every step. ``plain``: prepare with
    accelerate's own ``Accelerator.prepare``, skipping workbench's measurements. ``cpu``:
    return ``(seconds, cpu_seconds)``, the second the whole process's CPU time in each step
    (its background threads included, other processes not: steady on a busy machine).
    """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if plain:
        from accelerate import Accelerator

        model, optimizer = Accelerator.prepare(accelerator, model, optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    if log:
        import workbench
    g = torch.Generator().manual_seed(accelerator.process_index)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if log:
            workbench.log(loss=loss.detach())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return (times, cpu_times) if cpu else times


if __name__ == "__main__":
    from accelerate import Accelerator

    steps, out = int(sys.argv[1]), sys.argv[2]
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    accelerator = Accelerator(cpu=True)
    times = loop(accelerator, steps, width=width, cpu=True)
    if accelerator.process_index == 0:
        with open(out, "w") as f:
            json.dump(times, f)
