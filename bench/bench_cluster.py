"""(k) Two hosts over a shaped link: what each strategy's step costs, and how much is communication.

Needs root (hosts simulated with network namespaces, tests/simhosts.py); elsewhere it says why
in one line and reports nothing. A fleet of 2 hosts x 2 ranks (``--launcher ssh --hosts
hostA:2,hostB:2``, the kernel on hostA); hostB's link is shaped with ``tc tbf`` to each rate in
turn. For each rate and strategy (ddp, ddp with the fp16 and bf16 compression hooks, hsdp,
fsdp): the same 2-layer MLP (4M parameters, 16 MB of fp32 gradients), a warm-up step, then
STEPS steps; the median step time and workbench's communication time per step (the time in
collectives, summed over the step: DDP's own figure, FSDP's all-gathers and reduce-scatters,
hsdp's all-reduce across the hosts).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from common import RESULTS, report

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

RATES = ["1gbit", "200mbit", "50mbit"]
STRATEGIES = [("ddp", None), ("ddp", "fp16"), ("ddp", "bf16"), ("hsdp", None), ("fsdp", None)]
STEPS = 3

DRIVER = r'''
import json, statistics, sys, time
from workbench import CellOptions, Fleet
SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
import time
times = []
for _ in range({steps}):
    start = time.perf_counter()
    loss = model(torch.randn(32, 1024)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    times.append(time.perf_counter() - start)
times
"""
strategies, STEPS = json.loads(sys.argv[2]), int(sys.argv[3])
with Fleet(n=4, launcher="ssh", hosts="hostA:2,hostB:2", launcher_options={"ssh_args": sys.argv[1]},
           engine_timeout=120, progress=False, wandb=False, tensorboard=False) as fleet:
    print("READY", flush=True)
    for line in sys.stdin:
        rate = line.strip()
        if not rate:
            break
        for strategy, hook in strategies:
            options = CellOptions(strategy=strategy, comm_hook=hook)
            name = strategy + (f"+{hook}" if hook else "")
            try:
                fleet.run(SETUP, show_output=False, options=options)
                fleet.run(TRAIN.format(steps=1), show_output=False, options=options)  # warm-up
                first = len(fleet.metrics.store)
                times = fleet.run(TRAIN.format(steps=STEPS), show_output=False, options=options)
            except Exception as exc:  # reported as the row's result (the fleet recovers for the next row)
                print(json.dumps({"rate": rate, "strategy": name, "error": str(exc).splitlines()[0][:200]}),
                      flush=True)
                continue
            records = [r for r in fleet.metrics.store.since(first) if r.rank == 0]
            comm = [r.system["comm_s"] for r in records if "comm_s" in r.system]
            print(json.dumps({"rate": rate, "strategy": name, "step_s": statistics.median(times[0]),
                              "comm_s": statistics.median(comm) if comm else None}), flush=True)
        print("DONE", flush=True)
'''


def main() -> dict:
    from simhosts import SimulatedHosts, can_simulate

    why = can_simulate()
    if why:
        print(f"\n== cluster\n  skipped: {why}")
        return {}
    rows = []
    with SimulatedHosts(["hostA", "hostB"]) as hosts:
        script = hosts.folder / "bench_cluster_driver.py"
        script.write_text(DRIVER)
        driver = hosts.run("hostA", [sys.executable, str(script), " ".join(hosts.ssh_args), json.dumps(STRATEGIES),
                                      str(STEPS)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(RESULTS / "cluster_driver.log", "w"),
                           text=True,
                           cwd=hosts.folder, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            assert driver.stdout.readline().strip() == "READY", "the fleet did not start"
            for rate in RATES:
                hosts.shape("hostB", rate)
                driver.stdin.write(rate + "\n")
                driver.stdin.flush()
                for line in driver.stdout:
                    if line.strip() == "DONE":
                        break
                    if line.startswith("{"):
                        rows.append(json.loads(line))
            driver.stdin.write("\n")
            driver.stdin.flush()
            driver.wait(timeout=120)
        finally:
            if driver.poll() is None:
                driver.kill()
    table = {f"{r['rate']} {r['strategy']}": {"error": r["error"]} if "error" in r else
             {"step_s": round(r["step_s"], 3), "comm_s": round(r["comm_s"], 3) if r["comm_s"] is not None else None}
             for r in rows}
    return report("cluster", {"hosts": "2 x 2 ranks, hostB's link shaped (tc tbf)", "steps": STEPS, **table})


if __name__ == "__main__":
    main()
