"""Run on a simulated host by tests/test_cluster.py: a fleet whose ranks start on other hosts
through ipyparallel's ssh launcher. Prints one JSON line of results last.

``python cluster_driver.py placement '<ssh args>' '<hosts>' N '<more hosts>'``
``python cluster_driver.py host_loss '<ssh args>' '<hosts>' N [back|reboot]``: prints ``CELL STARTED``
when a long training cell starts (the test then kills or cuts off the last host); with ``back`` it
prints ``SHRUNK`` after going on without it and, once told on stdin, scales onto it again; with
``reboot`` it prints ``REFUSED`` after a refused recover and, once told, recovers onto it.
``python cluster_driver.py slurm - '<hosts>' N '<hosts with a node that never comes up>'``: the same
through Slurm (SLURM_CONF set by the test), one job per node; prints ``CELL STARTED`` too.
``python cluster_driver.py slurm_picks -``: Slurm without --hosts (see :func:`slurm_picks`).
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

from workbench import CellOptions, Fleet
from workbench.kernel.status import status_rows, status_table

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
"""
TRAIN = """
torch.manual_seed(100 + rank + workbench.step)
for _ in range(5):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
"""
PARAMS = "[p.full_tensor() if hasattr(p, 'full_tensor') else p.detach().clone() for p in model.parameters()]"
WHERE = "import os, socket; (socket.gethostname(), os.environ['MASTER_ADDR'], os.environ['LOCAL_RANK'], os.environ['NODE_RANK'])"


def same(a, b) -> bool:
    return all((x == y).all().item() for x, y in zip(a, b, strict=True))


def _trains_and_round_trips(fleet, result: dict, tag: str) -> list:
    """DDP agrees on every rank; a checkpoint restores exactly what was saved. Returns the params."""
    fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
    fleet.run(TRAIN, show_output=False)
    params = fleet.run(PARAMS, show_output=False)
    result["ddp_ranks_agree"] = all(same(params[0], p) for p in params[1:])
    fleet.checkpoints.save(tag=tag)
    fleet.run(TRAIN, show_output=False)
    result["trained_on"] = not same(params[0], fleet.run(PARAMS, show_output=False)[0])
    fleet.checkpoints.restore(tag)
    restored = fleet.run(PARAMS, show_output=False)
    result["restore_exact"] = all(same(a, b) for a, b in zip(params, restored, strict=True))
    return params


def placement() -> None:
    ssh_args, hosts, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    result = {"kernel_host": socket.gethostname()}
    started = time.monotonic()
    with Fleet(n=n, launcher="ssh", hosts=hosts, launcher_options={"ssh_args": ssh_args}, engine_timeout=90,
               progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs") as fleet:
        result["start_s"] = time.monotonic() - started
        result["where"] = fleet.run(WHERE, show_output=False)
        result["status"] = status_table(status_rows(fleet.pool))
        params = _trains_and_round_trips(fleet, result, "two-hosts")
        scaled = time.monotonic()
        fleet.scale(n + 1)
        result["scale_s"] = time.monotonic() - scaled
        result["where_scaled"] = fleet.run(WHERE, show_output=False)
        after = fleet.run(PARAMS, show_output=False)
        result["scaled_state_kept"] = all(same(params[0], p) for p in after)
        fleet.run(TRAIN, show_output=False)
        params = fleet.run(PARAMS, show_output=False)
        result["ddp_ranks_agree_scaled"] = all(same(params[0], p) for p in params[1:])
        result["status_scaled"] = status_table(status_rows(fleet.pool))
        try:  # every slot is taken: refused in one line, nothing changed
            fleet.scale(n + 2)
        except Exception as exc:
            result["no_slot_error"] = f"{type(exc).__name__}: {exc}"
        result["ranks_after_refusal"] = fleet.world_size
        fleet.scale(n + 2, hosts=sys.argv[5])
        result["where_more_hosts"] = fleet.run(WHERE, show_output=False)
        result["state_on_more_hosts"] = all(same(params[0], p) for p in fleet.run(PARAMS, show_output=False))
        result["metrics_from_ranks"] = sorted(fleet.metrics.store.streams)  # records or heartbeats
        result["unsigned_metrics"] = fleet.metrics.collector.rejected
    print(json.dumps(result))


LONG_TRAIN = """
import time
print("CELL STARTED", flush=True)
for _ in range(400):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    time.sleep(0.05)
"""


def host_loss() -> None:
    ssh_args, hosts, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    result = {}
    with Fleet(n=n, launcher="ssh", hosts=hosts, launcher_options={"ssh_args": ssh_args}, engine_timeout=90,
               progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs") as fleet:
        fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
        fleet.run(TRAIN, show_output=False)
        last_host = fleet.members[-1].host
        result["stale_pids"] = [m.pid for m in fleet.members if m.host == last_host]
        _lose_a_host_and_go_on(fleet, result, reboot=sys.argv[5:] == ["reboot"])
        if sys.argv[5:] == ["back"]:  # the test brings the lost host back, then a scale-up may use it again
            print("SHRUNK", flush=True)
            sys.stdin.readline()
            scaled = time.monotonic()
            fleet.scale(n)
            result["back_scale_s"] = time.monotonic() - scaled
            result["where_back"] = fleet.run(WHERE, show_output=False)
            params = fleet.run(PARAMS, show_output=False)
            result["back_state_kept"] = all(same(params[0], p) for p in params[1:])
            fleet.run(TRAIN, show_output=False)
            params = fleet.run(PARAMS, show_output=False)
            result["back_trains"] = all(same(params[0], p) for p in params[1:])
    print(json.dumps(result))


SLOW_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 3072), torch.nn.ReLU(), torch.nn.Linear(3072, 1024))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
"""
SLOW_TRAIN = """
import time
started = time.monotonic()
for _ in range(3):
    loss = model(torch.randn(16, 1024)).pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
time.monotonic() - started
"""


def slow_link() -> None:
    """DDP over a thin link (the test shapes it): the cell must not be called a mismatch."""
    ssh_args, hosts, n, strategy = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    result = {}
    with Fleet(n=n, launcher="ssh", hosts=hosts, launcher_options={"ssh_args": ssh_args}, engine_timeout=120,
               progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs") as fleet:
        fleet.run(SLOW_SETUP, strategy=strategy, show_output=False)
        try:
            result["seconds"] = fleet.run(SLOW_TRAIN, strategy=strategy, show_output=False)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        params = fleet.run(PARAMS, strategy=strategy, show_output=False)
        result["agree"] = all(same(params[0], p) for p in params[1:])
        result["comm_s"] = [sum(r.system.get("comm_s", 0.0) for r in fleet.metrics.store.since(0) if r.rank == rank)
                            for rank in range(n)]
        result["step_s"] = [sum(r.system.get("step_time_s", 0.0) for r in fleet.metrics.store.since(0)
                                if r.rank == rank) for rank in range(n)]
    print(json.dumps(result))


def _jobs() -> list[str]:
    """Slurm's jobs: ``id node state`` each."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %N %T"], capture_output=True, text=True, timeout=30)
    return sorted(out.stdout.split("\n")[:-1])


def _lose_a_host_and_go_on(fleet, result: dict, reboot: bool = False) -> None:
    """LONG_TRAIN, during which the test takes the last host away; then recover --shrink (or, with
    ``reboot``, recover onto the same host once the test says it is back) and train on."""
    try:
        fleet.run(LONG_TRAIN, show_output=True)
    except Exception as exc:
        result["failed_at"] = time.time()
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        result["notes"] = " ".join(getattr(exc, "notes", None) or [])
    try:  # no host has a free slot for the lost rank
        fleet.recover()
    except Exception as exc:
        result["recover_error"] = f"{type(exc).__name__}: {exc}"
    if reboot:
        print("REFUSED", flush=True)
        sys.stdin.readline()
    recovered = time.monotonic()
    fleet.recover(shrink=not reboot)
    result["recover_s"] = time.monotonic() - recovered
    _trains_on(fleet, result)


LONG_THEN_SHORT = LONG_TRAIN.replace(
    "import time\n", "import time\nsteps, steps_to_run = globals().get('steps_to_run', 5), 5\n").replace(
    "range(400)", "range(steps)")  # long, and short when --auto-recover runs it again (a fresh rank: short)


def _lose_a_host_auto_recovered(fleet, result: dict) -> None:
    """With --auto-recover: the test takes the last host away during LONG_THEN_SHORT; the fleet goes
    on without its ranks by itself (no free slot elsewhere) and runs the cell again."""
    notices = []

    class Notices(logging.Handler):
        def emit(self, record):
            notices.append((time.time(), record.getMessage()))

    logging.getLogger("workbench").addHandler(Notices())
    fleet.run("steps_to_run = 400", show_output=False)
    fleet.run(LONG_THEN_SHORT, show_output=True)
    result["failed_at"], result["auto_notice"] = next((t, m) for t, m in notices if "auto-recover" in m)
    _trains_on(fleet, result)


def _trains_on(fleet, result: dict) -> None:
    result["ranks_after"] = fleet.world_size
    result["where_after"] = fleet.run(WHERE, show_output=False)
    params = fleet.run(PARAMS, show_output=False)
    result["survivors_agree"] = all(same(params[0], p) for p in params[1:])
    result["step_after_recover"] = fleet.run("workbench.step", show_output=False)
    fleet.run(TRAIN, show_output=False)
    params = fleet.run(PARAMS, show_output=False)
    result["trains_on"] = all(same(params[0], p) for p in params[1:])
    result["step_after_training"] = fleet.run("workbench.step", show_output=False)


SLURM_OPTIONS = dict(launcher="slurm", progress=False, wandb=False, tensorboard=False, runs_dir="workbench-runs")
SLURM_TASK = "import os; os.environ['SLURM_JOB_ID'], os.environ['SLURM_NTASKS']"


def _where_in_jobs(fleet) -> list[list[str]]:
    """Each rank's host, MASTER_ADDR, LOCAL_RANK, NODE_RANK, Slurm job and the job's task count."""
    jobs = fleet.run(SLURM_TASK, show_output=False)
    return [[*where, *job] for where, job in zip(fleet.run(WHERE, show_output=False), jobs, strict=True)]


def slurm() -> None:
    hosts, n, never_up = sys.argv[3], int(sys.argv[4]), sys.argv[5]
    options = SLURM_OPTIONS
    result = {}
    started = time.monotonic()
    try:  # all or nothing: one node's job never starts
        with Fleet(n=2, hosts=never_up, engine_timeout=15, **options):
            result["never_up_error"] = "started"
    except Exception as exc:
        result["never_up_error"] = f"{type(exc).__name__}: {exc}"
    result["never_up_s"] = time.monotonic() - started
    result["jobs_after_failed_start"] = _jobs()
    started = time.monotonic()
    with Fleet(n=n, hosts=hosts, engine_timeout=90, auto_recover=True, **options) as fleet:
        result["start_s"] = time.monotonic() - started
        result["jobs"] = _jobs()
        result["where"] = _where_in_jobs(fleet)
        _trains_and_round_trips(fleet, result, "slurm")
        _lose_a_host_auto_recovered(fleet, result)
        result["jobs_after_loss"] = _jobs()
    print(json.dumps(result))


def slurm_picks() -> None:
    """Without --hosts: Slurm picks the nodes, one job of a node's size (sinfo) each. Prints
    ``LOSE <host>`` (the last rank's node) and waits for a line on stdin (the test makes a node
    free for the replacement), then loses that host mid-cell like :func:`slurm`."""
    result = {}
    started = time.monotonic()
    with Fleet(n=4, engine_timeout=90, auto_recover=True, **SLURM_OPTIONS) as fleet:
        result["start_s"] = time.monotonic() - started
        result["jobs"] = _jobs()
        result["where"] = _where_in_jobs(fleet)
        _trains_and_round_trips(fleet, result, "slurm")
        print("LOSE", fleet.members[-1].host, flush=True)
        sys.stdin.readline()
        _lose_a_host_auto_recovered(fleet, result)
        result["where_recovered"] = _where_in_jobs(fleet)
        result["jobs_after_loss"] = _jobs()
    print(json.dumps(result))


def attach() -> None:
    """An ipcluster of ssh engines on hostA and hostB (not ours); the fleet attaches to 2 of them,
    replaces hostB's rank after it died, and scales to 4."""
    import os

    import ipyparallel as ipp

    ssh_args = sys.argv[2]
    os.environ["IPYTHONDIR"] = os.path.abspath("ipython")
    cluster = ipp.Cluster(profile="sim", cluster_id="sim", engines="ssh", controller_ip="*", log_level=40)
    section = cluster.config.SSHEngineSetLauncher
    section.engines = {"hostA": {"n": 1, "to_send": []}, "hostB": {"n": 1, "to_send": []}}
    section.ssh_args = ssh_args.split()
    section.scp_args = ssh_args.split()
    section.remote_python = sys.executable
    cluster.start_cluster_sync()
    result = {}
    try:
        with Fleet(n=2, profile="sim", cluster_id="sim", launcher="ssh", launcher_options={"ssh_args": ssh_args},
                   engine_timeout=90, progress=False, wandb=False, tensorboard=False,
                   runs_dir="workbench-runs") as fleet:
            result["where"] = [w[0] for w in fleet.run(WHERE, show_output=False)]
            fleet.execute(SETUP, CellOptions(), show_output=False, setup=True)
            fleet.run(TRAIN, show_output=False)
            try:
                fleet.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", ranks=[1], show_output=False)
            except Exception as exc:
                result["died"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            fleet.recover()
            result["where_replaced"] = [w[0] for w in fleet.run(WHERE, show_output=False)]
            fleet.scale(4)
            result["where_scaled"] = [w[0] for w in fleet.run(WHERE, show_output=False)]
            fleet.run(TRAIN, show_output=False)
            params = fleet.run(PARAMS, show_output=False)
            result["ddp_ranks_agree"] = all(same(params[0], p) for p in params[1:])
        client = cluster.connect_client_sync()
        result["cluster_engines_after_stop"] = len(client.ids)  # its own 2, one of them killed: 1
        client.close()
    finally:
        cluster.stop_cluster_sync()
    print(json.dumps(result))


if __name__ == "__main__":
    {"placement": placement, "host_loss": host_loss, "slow_link": slow_link, "slurm": slurm,
     "slurm_picks": slurm_picks, "attach": attach}[sys.argv[1]]()
