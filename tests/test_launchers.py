"""Fleets through ipyparallel's launchers (MPI, a real local Slurm), a running ipcluster,
two simulated nodes, and per-engine memory limits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import fleet_processes, started_here, wait_until_gone
from simhosts import slurm_conf

from workbench import Fleet, FleetOptions, OptionsError
from workbench.kernel.launchers import LauncherSpec, parse_options
from workbench.options import parse_size

DDP_CELL = """
import torch
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
loss = model(torch.randn(4, 8) + rank).pow(2).mean()
accelerator.backward(loss); optimizer.step()
type(model).__name__, world_size, float(model.module.weight.grad.sum()) if hasattr(model, "module") else None
"""


def test_a_launcher_config_file_and_options_land_in_the_clusters_config(tmp_path):
    import ipyparallel as ipp

    config = tmp_path / "slurm_config.py"
    config.write_text("c.SlurmEngineSetLauncher.timelimit = '02:00:00'\nc.SlurmEngineSetLauncher.qos = 'low'\n")
    spec = LauncherSpec("slurm", {"qos": "high"}, str(config))
    cluster = ipp.Cluster(profile_dir=str(tmp_path / "profile"), **spec.cluster_kwargs())
    spec.configure(cluster)
    section = cluster.config.SlurmEngineSetLauncher
    assert section.timelimit == "02:00:00" and section.qos == "high", "options given by name win over the file"
    with pytest.raises(OptionsError, match="is not a file"):
        LauncherSpec("slurm", config_file=str(tmp_path / "missing.py"))


def test_launcher_options_are_checked_against_ipyparallel():
    spec = LauncherSpec("slurm", {"partition": "gpu", "time": "01:00:00", "account": "ml"})
    assert spec.traits == {"queue": "gpu", "timelimit": "01:00:00", "account": "ml"}
    assert spec.launcher_class().__name__ == "SlurmEngineSetLauncher"
    assert spec.cluster_kwargs() == {"engines": "slurm", "controller_ip": "*"}
    assert LauncherSpec("mpi").cluster_kwargs() == {"engines": "mpi"}  # engines on this host: localhost only
    with pytest.raises(OptionsError, match="has no option 'bogus'; it knows: account"):
        LauncherSpec("slurm", {"bogus": "1"})
    with pytest.raises(OptionsError, match="unknown launcher 'yarn'; use one of: local, .*htcondor.*lsf.*sge"):
        LauncherSpec("yarn")
    # ipyparallel's other launchers, found by its own lookup: a batch system's options by its trait names
    lsf = LauncherSpec("lsf", {"partition": "short"})
    assert lsf.traits == {"queue": "short"} and lsf.launcher_class().__name__ == "LSFEngineSetLauncher"
    assert lsf.cluster_kwargs() == {"engines": "lsf", "controller_ip": "*"} and not lsf.node_jobs
    assert FleetOptions(n=2, launcher="sge", partition="all.q").validate().launcher == "sge"
    with pytest.raises(OptionsError, match="the sge launcher has no option 'time'"):
        LauncherSpec("sge", {"time": "01:00:00"})
    with pytest.raises(OptionsError, match="option of a cluster launcher"):
        LauncherSpec("local", {"partition": "x"})
    assert parse_options(["qos=high", "mpi_args=--bind-to none"]) == {"qos": "high", "mpi_args": ["--bind-to", "none"]}
    with pytest.raises(OptionsError, match="KEY=VALUE"):
        parse_options(["qos"])
    assert parse_size("4G") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size(None) is None
    with pytest.raises(OptionsError, match="below 1 MiB"):
        parse_size("4")
    with pytest.raises(OptionsError, match="needs -n"):
        Fleet(launcher="slurm")
    with pytest.raises(OptionsError, match="the scheduler assigns them"):
        Fleet(n=2, launcher="slurm", gpus="0,1")


def test_slurm_picking_the_nodes_sizes_a_job_by_a_nodes_gpus_from_sinfo(tmp_path, monkeypatch):
    """Without --hosts, a job has a node's GPUs as sinfo reports them (the smallest node), each task
    one GPU of it, else a node's CPUs; a lost node is excluded. ``sinfo`` is a script here: a GPU
    node cannot exist on this machine. The real Slurm runs in test_cluster and the tests below."""
    from workbench.kernel.devices import EngineSlot
    from workbench.kernel.launchers import slurm_node_size

    (tmp_path / "sinfo").write_text("#!/bin/sh\necho '96 gpu:h100:8(S:0-1)'\necho '64 gpu:4,tmp:100'\n")
    (tmp_path / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    slurm_node_size.cache_clear()
    try:
        spec = LauncherSpec("slurm")
        assert spec.ranks_per_node() == 4
        kwargs = spec.engine_set_kwargs([EngineSlot(0), EngineSlot(1)], avoid=["nodeB", "nodeA"])
        assert kwargs["submit_command"] == ["sbatch", "--nodes=1", "--exclude=nodeA,nodeB", "--gres=gpu:2"]
        assert LauncherSpec("slurm", per_node=2).ranks_per_node() == 2
        assert LauncherSpec("slurm").engine_set_kwargs([EngineSlot(0, host="nodeC")])["submit_command"] == [
            "sbatch", "--nodes=1", "--nodelist=nodeC"]
        (tmp_path / "sinfo").write_text("#!/bin/sh\necho '16 (null)'\necho '32 (null)'\n")
        slurm_node_size.cache_clear()
        assert slurm_node_size(None) == (16, 0)
        (tmp_path / "sinfo").write_text("#!/bin/sh\n")
        slurm_node_size.cache_clear()
        with pytest.raises(OptionsError, match="sinfo lists no node in partition gpu; give --ranks-per-node K"):
            slurm_node_size("gpu")
    finally:
        slurm_node_size.cache_clear()
    gpu_fleet = Fleet(n=2, launcher="slurm", backend="nccl", progress=False)  # not started
    assert gpu_fleet.pool.new_slots(2) == [EngineSlot(0), EngineSlot(1)], "the scheduler gives the GPUs"
    with pytest.raises(OptionsError, match="--ranks-per-node sizes the jobs of --launcher slurm"):
        Fleet(n=4, launcher="slurm", hosts="a:2,b:2", ranks_per_node=2)
    with pytest.raises(OptionsError, match="--ranks-per-node sizes the jobs"):
        Fleet(n=4, launcher="ssh", ranks_per_node=2)
    with pytest.raises(OptionsError, match="--ranks-per-node"):
        Fleet(n=4, launcher="slurm", ranks_per_node=0)


@pytest.mark.fleet
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no MPI here (.ci/run installs openmpi-bin)")
def test_mpi_launcher_runs_a_ddp_cell_and_leaves_nothing():
    before = {p.pid for p in fleet_processes()}
    with Fleet(n=2, launcher="mpi", progress=False, wandb=False) as fleet:
        got = fleet.run(DDP_CELL, show_output=False)
        assert [g[:2] for g in got] == [("DistributedDataParallel", 2)] * 2
        assert got[0][2] == got[1][2], "gradients were averaged across the ranks"
        launched = fleet.run("import os; os.environ.get('OMPI_COMM_WORLD_SIZE')", show_output=False)
        assert launched == ["1", "1"], "each rank is its own mpiexec -n 1"
        pids = [m.pid for m in fleet.members]
    assert not wait_until_gone(pids)
    assert not [p for p in fleet_processes() if p.pid not in before and p.is_running()]
    assert not [p for p in _processes("mpiexec", "orted")], "mpiexec is gone too"


def _processes(*names):
    """This test session's processes called one of ``names``."""
    import psutil

    return [p for p in psutil.process_iter(["name"]) if p.info["name"] in names and started_here(p)]


@pytest.mark.fleet
def test_two_simulated_nodes_get_node_ranks_local_ranks_and_a_grouped_status():
    fleet = Fleet(n=4, progress=False, wandb=False, memory_limit="6G")
    # slots 0 and 2 on node-a, 1 and 3 on node-b: a node's ranks must come out consecutive
    fleet.pool.slot_environment = {0: {"WORKBENCH_HOSTNAME": "node-a"}, 1: {"WORKBENCH_HOSTNAME": "node-b"},
                              2: {"WORKBENCH_HOSTNAME": "node-a"}, 3: {"WORKBENCH_HOSTNAME": "node-b"}}
    with fleet:
        env = fleet.run("import os; tuple(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', "
                        "'NODE_RANK', 'WORKBENCH_SLOT'))", show_output=False)
        assert env == [("0", "0", "2", "0", "0"), ("1", "1", "2", "0", "2"),
                       ("2", "0", "2", "1", "1"), ("3", "1", "2", "1", "3")]
        assert [m.host for m in fleet.members] == ["node-a", "node-a", "node-b", "node-b"]
        assert fleet.run("local_rank", show_output=False) == [0, 1, 0, 1]
        assert fleet.run("import torch; t = torch.ones(1); torch.distributed.all_reduce(t); t.item()",
                         show_output=False) == [4.0] * 4, "the group spans both nodes (TCP rendezvous)"
        from workbench.kernel.status import status_table

        table = status_table(fleet.status())
        assert "node 0: node-a (2 ranks)" in table and "node 1: node-b (2 ranks)" in table
        assert table.index("node-a (2") < table.index("node 1")

        # --memory-limit: going over it is that rank's error, named as such; the fleet lives on
        from workbench import DistributedCellError

        with pytest.raises(DistributedCellError) as caught:
            fleet.run("import torch\nif rank == 3:\n    big = torch.empty(2**31)  # 8 GiB\nrank", show_output=False)
        report = caught.value.report()
        assert "rank 3 of 4" in report and "memory limit (6 GiB, --memory-limit) was reached" in report, report
        assert fleet.run("rank", show_output=False) == [0, 1, 2, 3]
        assert fleet.run("import resource; resource.getrlimit(resource.RLIMIT_AS)[0]", show_output=False) == [
            6 * 2**30] * 4


@pytest.fixture
def ipcluster(tmp_path, monkeypatch):
    """A real ipcluster with 2 engines, started outside workbench, in its own IPython dir."""
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")}
    cmd = [sys.executable, "-m", "ipyparallel.cluster", "start", "-n", "2", "--profile", "wbtest", "--daemonize",
           "--cluster-id", "attached"]
    subprocess.run(cmd, env=env, check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield
    subprocess.run([sys.executable, "-m", "ipyparallel.cluster", "stop", "--profile", "wbtest", "--cluster-id",
                    "attached"], env=env, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_attaching_to_a_running_ipcluster_uses_its_engines_and_leaves_them_running(ipcluster):
    fleet = Fleet(profile="wbtest", cluster_id="attached", progress=False, wandb=False, engine_timeout=60)
    with fleet:
        assert fleet.world_size == 2
        assert fleet.run("import torch; t = torch.ones(1); torch.distributed.all_reduce(t); t.item()",
                         show_output=False) == [2.0, 2.0]
        pids = [m.pid for m in fleet.members]
    time.sleep(0.5)
    assert all(_alive(p) for p in pids), "the cluster is the user's: its engines keep running"


def test_attached_without_n_scales_saves_and_stops_only_what_it_added(ipcluster):
    """Was: scale after attaching without -n raised ZeroDivisionError; engines the fleet added
    survived %fleet stop; after stop and a new attach every checkpoint save failed (its DCP group
    was cached by a generation number that starts again)."""
    fleet = Fleet(profile="wbtest", cluster_id="attached", progress=False, wandb=False, engine_timeout=60)
    with fleet:
        theirs = [m.pid for m in fleet.members]
        fleet.run("import torch\nt = torch.nn.Linear(4, 4)\nmodel = accelerator.prepare(t)", show_output=False)
        fleet.checkpoints.save(tag="attached-1")
        fleet.scale(3)
        assert fleet.world_size == 3
        added = [m.pid for m in fleet.members if m.pid not in theirs]
        assert len(added) == 1
    time.sleep(0.5)
    assert all(_alive(p) for p in theirs) and not _alive(added[0]), "the engine the fleet added is stopped"
    with Fleet(profile="wbtest", cluster_id="attached", progress=False, wandb=False, engine_timeout=60) as again:
        assert again.world_size == 2
        again.run("import torch\nt = torch.nn.Linear(4, 4)\nmodel = accelerator.prepare(t)", show_output=False)
        assert again.checkpoints.save(tag="attached-2") == "attached-2"


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """A real Slurm on this machine: munged, slurmctld and slurmd (Debian's slurm-wlm), as root."""
    import socket

    if not all(shutil.which(t) for t in ("munged", "slurmctld", "slurmd", "sbatch")) or os.geteuid() != 0:
        pytest.skip("needs root and Debian's slurm-wlm + munge (.ci/run installs them)")
    host = socket.gethostname()
    folder = tmp_path / "slurm"
    for sub in ("state", f"spool-{host}"):
        (folder / sub).mkdir(parents=True)
    folder.chmod(0o700)
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, host, {host: None}, ports=(_free_port(), _free_port())))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    key = "/etc/munge/munge.key"
    if not os.path.exists(key):
        key = str(folder / "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
    subprocess.run(["munged", "--force", "-S", str(folder / "munge.sock"), f"--key-file={key}",
                    f"--log-file={folder / 'munged.log'}", f"--pid-file={folder / 'munged.pid'}",
                    f"--seed-file={folder / 'munged.seed'}"], check=True, timeout=30)
    subprocess.run(["slurmctld"], check=True, timeout=30)
    subprocess.run(["slurmd"], check=True, timeout=30)
    deadline = time.monotonic() + 30
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, (folder / "slurmctld.log").read_text()[-2000:]
        time.sleep(0.5)
    yield folder
    for daemon in (f"slurmd-{host}", "slurmctld"):
        pid_file = folder / f"{daemon}.pid"
        if pid_file.exists():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)
    subprocess.run(["munged", "-s", "-S", str(folder / "munge.sock")], check=False, timeout=30)


def _jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=30)
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else [f"squeue failed: {out.stderr}"]


def test_slurm_launcher_runs_a_ddp_cell_in_a_batch_job_that_ends_with_the_fleet(slurm):
    with Fleet(n=2, launcher="slurm", launcher_options={"partition": "debug"}, progress=False, wandb=False) as fleet:
        jobs = _jobs()
        assert len(jobs) == 1 and jobs[0].endswith("RUNNING"), jobs
        got = fleet.run(DDP_CELL, show_output=False)
        assert [g[:2] for g in got] == [("DistributedDataParallel", 2)] * 2 and got[0][2] == got[1][2]
        job_ids = fleet.run("import os; os.environ['SLURM_JOB_ID'], os.environ['SLURM_PROCID']", show_output=False)
        assert job_ids == [(jobs[0].split()[0], "0"), (jobs[0].split()[0], "1")], "the ranks are one job's tasks"
    deadline = time.monotonic() + 30
    while _jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _jobs() == [], "the jobs are gone after the fleet stopped"


def test_a_rank_of_a_slurm_job_is_replaced_alone_and_its_job_mate_keeps_its_state(slurm):
    """Two ranks are one job's two tasks. Rank 1 is killed: the cell fails naming it, recover
    starts a new one-task job for it, and rank 0, in the first job still, keeps its namespace."""
    import signal

    from workbench import DistributedCellError, FleetError

    with Fleet(n=2, launcher="slurm", progress=False, wandb=False) as fleet:
        fleet.run("kept = rank * 10", show_output=False)
        first_job = _jobs()[0].split()[0]
        os.kill(fleet.member(1).pid, signal.SIGKILL)
        with pytest.raises((DistributedCellError, FleetError), match="rank 1 .*died"):
            fleet.run("import time; time.sleep(3)", show_output=False)
        fleet.recover()
        jobs = [j.split()[0] for j in _jobs()]
        assert first_job in jobs and len(jobs) == 2, jobs
        assert fleet.run("kept", ranks=[0], show_output=False) == [0]
        assert fleet.run("import os; os.environ['SLURM_JOB_ID']", show_output=False)[0] == first_job
        assert fleet.run(DDP_CELL, show_output=False)[0][:2] == ("DistributedDataParallel", 2)
    deadline = time.monotonic() + 30
    while _jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _jobs() == [], "both jobs are gone after the fleet stopped"
