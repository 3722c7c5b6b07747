"""Fleets across hosts, on hosts simulated here (tests/simhosts.py: network namespaces on a
bridge, each with its own hostname and sshd; root only, skipped elsewhere with one line).
The kernel runs on hostA (tests/cluster_driver.py); ``--hosts`` places the ranks through
ipyparallel's ssh launcher."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from simhosts import SimulatedHosts, can_simulate, cmdline

from workbench import FleetOptions
from workbench.errors import OptionsError
from workbench.placement import Hosts

HERE = os.path.dirname(os.path.abspath(__file__))


def test_hosts_fill_in_order_and_refuse_in_one_line(tmp_path):
    hosts = Hosts.parse("hostA:2,hostB:2")
    assert hosts.assign(3, []) == ["hostA", "hostA", "hostB"]
    assert hosts.assign(1, ["hostA", "hostB", "hostA"]) == ["hostB"]
    with pytest.raises(OptionsError, match=r"^2 more engines need 2 free slots but the hosts have 1 \(free: hostB:1\); "
                                           r"add hosts with --hosts HOST:N$"):
        hosts.assign(2, ["hostA", "hostA", "hostB"])
    hosts.add(Hosts.parse("hostC"))
    assert hosts.assign(2, ["hostA", "hostA", "hostB"]) == ["hostB", "hostC"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode1 slots=4\nnode2:2\nnode3\n\n")
    assert Hosts.read(str(hostfile)).slots == {"node1": 4, "node2": 2, "node3": 1}
    hostfile.write_text("node1 slots=x\n")
    with pytest.raises(OptionsError, match=r"line 1: expected 'HOST slots=N'"):
        Hosts.read(str(hostfile))
    for bad in ("hostA:0", "hostA:2,hostA:1", "host A", ""):
        with pytest.raises(OptionsError):
            Hosts.parse(bad)


def test_hosts_options_are_checked_before_anything_starts():
    assert FleetOptions(launcher="ssh", hosts="a:2,b:2").validate().n == 4  # -n defaults to the slots
    with pytest.raises(OptionsError, match=r"-n 5 needs 5 slots but the hosts have 4 \(a:2,b:2\)"):
        FleetOptions(n=5, launcher="ssh", hosts="a:2,b:2").validate()
    assert FleetOptions(launcher="slurm", hosts="a:2,b:2").validate().n == 4  # one job per host
    for launcher in ("local", "pbs", "mpi"):
        with pytest.raises(OptionsError, match="place engines with --launcher ssh or slurm"):
            FleetOptions(n=2, hosts="a:2", launcher=launcher).validate()
    with pytest.raises(OptionsError, match="--hosts or --hostfile, not both"):
        FleetOptions(launcher="ssh", hosts="a:2", hostfile="/x").validate()


@pytest.fixture(scope="module")
def hosts():
    why = can_simulate()
    if why:
        pytest.skip(why)
    with SimulatedHosts(["hostA", "hostB", "hostC"]) as simulated:
        yield simulated


def _others(hosts, host) -> list[int]:
    """Processes on ``host`` other than its daemons (sshd, and slurmd/slurmctld once Slurm runs)."""
    return [p for p in hosts.pids(host)
            if not any(daemon in _cmdline(p) for daemon in ("sshd", "slurmd", "slurmctld", "slurmscriptd"))]


def _cmdline(pid: int) -> str:
    return cmdline(pid, gone="sshd")  # gone meanwhile: counts as nothing left


def _nothing_left(hosts) -> None:
    """Nothing of the fleet outlives it, on any host."""
    deadline = time.monotonic() + 15
    while any(_others(hosts, h) for h in hosts.names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_others(hosts, h) for h in hosts.names), {h: [_cmdline(p) for p in _others(hosts, h)]
                                                             for h in hosts.names}


def _start_driver(hosts, tmp_path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """tests/cluster_driver.py on hostA (the kernel's host). Its stderr goes to a file: a pipe nobody
    reads while the test waits for a line on stdout would fill up and stop the driver."""
    err_path = tmp_path / "driver.err"
    with open(err_path, "w") as err:
        driver = hosts.run("hostA", [sys.executable, os.path.join(HERE, "cluster_driver.py"), args[0],
                                     " ".join(hosts.ssh_args), *args[1:]],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=tmp_path,
                           env={**os.environ, **(env or {})})
    driver.err_path = err_path
    return driver


def _errors(driver: subprocess.Popen) -> str:
    return driver.err_path.read_text(errors="replace")[-3000:]


def _result(driver: subprocess.Popen) -> dict:
    """The driver's JSON line, once it ended (killed after 300 s)."""
    try:
        out, _ = driver.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        driver.kill()
        out, _ = driver.communicate()
    assert driver.returncode == 0, _errors(driver)
    return json.loads(out.strip().splitlines()[-1])


def test_a_fleet_across_hosts_over_ssh(hosts, tmp_path):
    started = time.monotonic()
    result = _result(_start_driver(hosts, tmp_path, "placement", "hostA:1,hostB:2", "2", "hostC:1"))
    print(f"2 hosts: started in {result['start_s']:.1f} s, scaled onto hostB in {result['scale_s']:.1f} s; "
          f"whole test {time.monotonic() - started:.0f} s\n{result['status_scaled']}")
    address = hosts.addresses["hostA"]
    assert result["kernel_host"] == "hostA"
    # rank 0 on hostA, rank 1 on hostB; rank 0's address is hostA's interface, never loopback
    assert result["where"] == [["hostA", address, "0", "0"], ["hostB", address, "0", "1"]]
    assert "node 0: hostA (1 rank)" in result["status"] and "node 1: hostB (1 rank)" in result["status"]
    assert result["ddp_ranks_agree"] and result["trained_on"] and result["restore_exact"]
    # scale-up takes hostB's free slot; the state comes along
    assert [w[0] for w in result["where_scaled"]] == ["hostA", "hostB", "hostB"]
    assert [w[2:] for w in result["where_scaled"]] == [["0", "0"], ["0", "1"], ["1", "1"]]
    assert "node 1: hostB (2 ranks)" in result["status_scaled"]
    assert result["scaled_state_kept"] and result["ddp_ranks_agree_scaled"]
    # no slot left: one line, nothing changed; --hosts adds one
    assert result["no_slot_error"] == ("OptionsError: 1 more engines need 1 free slots but the hosts have 0 (free: none); "
                                       "add hosts with --hosts HOST:N")
    assert result["ranks_after_refusal"] == 3
    assert [w[0] for w in result["where_more_hosts"]] == ["hostA", "hostB", "hostB", "hostC"]
    assert result["state_on_more_hosts"]
    # hostB's and hostC's ranks sent their metrics over TCP, signed with the run's key
    assert result["metrics_from_ranks"] == [0, 1, 2, 3] and result["unsigned_metrics"] == 0
    _nothing_left(hosts)


def _lose_host_mid_cell(hosts, tmp_path, lose, come_back, driver=None, host="hostC",
                        back: str | None = None) -> tuple[dict, float]:
    """``host`` (default hostC, rank 2 of 3 in ``host_loss``) is lost (``lose``) two seconds into a
    training cell; then it comes back (``come_back``): for the tests after this one, or, with
    ``back`` (``back`` or ``reboot``, the driver's mode), while the driver runs on. Returns the
    driver's result and the seconds until the cell failed."""
    driver = driver or _start_driver(hosts, tmp_path, "host_loss", "hostA:1,hostB:1,hostC:1", "3",
                                     *([back] if back else []))
    try:
        _read_until(driver, "CELL STARTED")
        time.sleep(2.0)  # a few steps in
        lost_at = time.time()
        lose(host)
        if back:
            _read_until(driver, {"back": "SHRUNK", "reboot": "REFUSED"}[back])
            come_back()
            come_back = None
            driver.stdin.write("back\n")
            driver.stdin.flush()
        result = _result(driver)
    finally:
        if driver.poll() is None:  # the test failed while the driver runs: it ends (its reaper ends its fleet)
            driver.kill()
        if come_back is not None:  # not back yet
            come_back()
    return result, result["failed_at"] - lost_at


def _read_until(driver: subprocess.Popen, mark: str) -> str:
    for line in driver.stdout:
        if mark in line:
            return line
    raise AssertionError(f"the driver ended before {mark!r}: {_errors(driver)}")


def _trained_on_after_recovery(result: dict, where: tuple[str, ...] = ("hostA", "hostB")) -> None:
    """After the recovery the ranks are on ``where``, with the survivors' live replica (the steps
    trained before and in the failed cell), and training goes on."""
    assert result["ranks_after"] == len(where) and tuple(w[0] for w in result["where_after"]) == where
    assert result["survivors_agree"] and result["trains_on"]
    steps = result["step_after_recover"]
    assert len(set(steps)) == 1 and steps[0] > 5, steps
    assert result["step_after_training"] == [steps[0] + 5] * len(where)


def _restart_sshd(hosts, host):
    hosts._start_sshd(host)
    hosts._wait_ssh(host)


def test_a_killed_host_is_named_in_seconds_and_the_others_keep_their_state(hosts, tmp_path):
    """Every process of hostC killed mid-cell (the machine died): the cell fails within 5 s naming
    the host; the healthy ranks are not killed. recover is refused while no host has a free slot;
    once hostC is back (rebooted: its sshd answers), recover puts rank 2 there again, with the
    survivors' live replica."""
    result, noticed = _lose_host_mid_cell(hosts, tmp_path, hosts.kill_host, lambda: _restart_sshd(hosts, "hostC"),
                                          back="reboot")
    print(f"hostC killed: the cell failed after {noticed:.1f} s: {result['error']}; back: recover onto it "
          f"{result['recover_s']:.1f} s")
    assert noticed < 5.0, noticed
    assert result["error"] == ("DistributedCellError: host hostC lost (ranks 2): its ranks went silent and the host "
                               "refuses connections (its processes are gone); the other ranks failed because of it")
    assert "The other ranks keep their state" in result["notes"]
    assert result["recover_error"] == ("OptionsError: rank 2 ran on hostC, which is lost, and no other host has a free "
                                       "slot: %fleet recover --shrink goes on without them (then %fleet scale N "
                                       "--hosts HOST:K adds a host)")
    _trained_on_after_recovery(result, ("hostA", "hostB", "hostC"))


def test_a_cut_off_host_is_named_and_the_others_collectives_end_with_their_state(hosts, tmp_path):
    """hostC's link goes down mid-cell (its processes live on): named 'unreachable' within 10 s; the
    other ranks, blocked in a collective with it, are released by cutting their links to it (not
    killed, not left until --pg-timeout); recover --shrink goes on from their live replica. Then
    the link comes back: a scale-up stops hostC's stale engine first (fenced), and puts a new one there."""
    def come_back():
        hosts.mend("hostC")
        hosts._wait_ssh("hostC")  # the link is up again

    result, noticed = _lose_host_mid_cell(hosts, tmp_path, hosts.cut, come_back, back="back")
    print(f"hostC cut off: the cell failed after {noticed:.1f} s: {result['error']}; recover --shrink "
          f"{result['recover_s']:.1f} s; back: scaled onto it again in {result['back_scale_s']:.1f} s")
    assert noticed < 10.0, noticed
    assert result["error"] == ("DistributedCellError: host hostC unreachable (ranks 2): its ranks went silent and the "
                               "host does not answer on the network (a partition, or the machine is down); the other "
                               "ranks failed because of it")
    assert result["recover_s"] < 30, "the survivors' collective ended when their links to hostC were cut"
    _trained_on_after_recovery(result)
    assert [w[0] for w in result["where_back"]] == ["hostA", "hostB", "hostC"]
    assert result["back_state_kept"] and result["back_trains"]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in result["stale_pids"]), "the stale engine was fenced"
    _nothing_left(hosts)


def test_attached_to_an_ipcluster_across_hosts_new_engines_are_placed_by_host(hosts, tmp_path):
    """Was: attached to an ipcluster of ssh engines, new and replacement engines all went to its
    first host. Now a replacement takes its rank's host, and a scale-up the host with the fewest."""
    result = _result(_start_driver(hosts, tmp_path, "attach"))
    print(f"attached: {result}")
    assert result["where"] == ["hostA", "hostB"]
    assert "rank 1" in result["died"] and "died" in result["died"]
    assert result["where_replaced"] == ["hostA", "hostB"]
    assert result["where_scaled"] == ["hostA", "hostA", "hostB", "hostB"]
    assert result["ddp_ranks_agree"]
    assert result["cluster_engines_after_stop"] == 1, "only the engines the fleet added were stopped"
    _nothing_left(hosts)


@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_a_thin_link_is_slow_not_a_mismatch(hosts, tmp_path, strategy):
    """DDP and hsdp, 2 hosts x 2 ranks, hostB's link at 50 Mbit/s: each step's all-reduce of 25 MB
    takes seconds (longer than the mismatch rule's 5 s), and no rank is called stuck in a mismatched
    collective while the others progress, also when the first rank finishes the cell seconds before
    the last one's all-reduce ends."""
    hosts.shape("hostB", "50mbit")
    try:
        result = _result(_start_driver(hosts, tmp_path, "slow_link", "hostA:2,hostB:2", "4", strategy))
    finally:
        hosts.unshape("hostB")
    print(f"{strategy} over 50 Mbit/s: {result.get('seconds')} s for 3 steps; comm {result['comm_s']} of "
          f"{result['step_s']} s")
    assert "error" not in result, result["error"]
    assert result["agree"]
    assert max(result["seconds"]) > 2.0, "the link was not thin"
    # the time in collectives is counted, also hsdp's all-reduce across the hosts: most of the step here
    assert all(comm > 0.5 * step for comm, step in zip(result["comm_s"], result["step_s"], strict=True)), result


@pytest.fixture(scope="module")
def slurm_conf(hosts):
    """Slurm over the simulated hosts: slurmctld on hostA, slurmd on hostA and hostB; hostC is a
    node of the cluster that never comes up."""
    from simhosts import SLURM_TOOLS

    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install -y slurm-wlm munge; .ci/run does)")
    return hosts.start_slurm(nodes=["hostA", "hostB"])


def test_slurm_starts_one_job_per_node_all_or_nothing_and_names_a_lost_node(hosts, slurm_conf, tmp_path):
    """--launcher slurm --hosts hostA:2,hostB:2: one job per node, each with its node's 2 ranks as
    tasks. A start whose node never comes up fails whole within --engine-timeout, naming the job
    that waits, and leaves no job. hostB killed mid-cell with --auto-recover: named within 5 s (its
    slurmd is gone), hostA's ranks keep their state and their job, and the fleet goes on without
    hostB by itself (no free slot elsewhere), running the cell again."""
    driver = _start_driver(hosts, tmp_path, "slurm", "hostA:2,hostB:2", "4", "hostA:1,hostC:1",
                           env={"SLURM_CONF": str(slurm_conf)})
    result, noticed = _lose_host_mid_cell(hosts, tmp_path, hosts.kill_host, lambda: _restart_sshd(hosts, "hostB"),
                                          driver=driver, host="hostB")
    print(f"slurm: a node that never came up failed the start in {result['never_up_s']:.1f} s: "
          f"{result['never_up_error']}\nstarted 2 nodes in {result['start_s']:.1f} s: {result['jobs']}; hostB killed: "
          f"auto-recover began after {noticed:.1f} s: {result['auto_notice']}")
    assert result["never_up_error"].startswith("FleetError: only 1 of 2 engines registered within 15 s (Slurm job ")
    assert "PENDING" in result["never_up_error"] and result["never_up_error"].endswith(" for hostC); none are kept")
    assert result["never_up_s"] < 45
    assert not any(job.endswith("RUNNING") or job.endswith("PENDING") for job in result["jobs_after_failed_start"])
    jobs = [job.split() for job in result["jobs"]]
    assert [(node, state) for _, node, state in jobs] == [("hostA", "RUNNING"), ("hostB", "RUNNING")], jobs
    job_of = {node: job for job, node, _ in jobs}
    address = hosts.addresses["hostA"]
    assert result["where"] == [["hostA", address, "0", "0", job_of["hostA"], "2"],
                               ["hostA", address, "1", "0", job_of["hostA"], "2"],
                               ["hostB", address, "0", "1", job_of["hostB"], "2"],
                               ["hostB", address, "1", "1", job_of["hostB"], "2"]]
    assert result["ddp_ranks_agree"] and result["trained_on"] and result["restore_exact"]
    assert noticed < 5.0, noticed
    assert result["auto_notice"] == (
        "auto-recover 1/3: host hostB lost (ranks 2,3): its ranks went silent and the host refuses connections (its "
        "processes are gone) during the cell; recovering without the lost host's ranks (no free slot elsewhere) (a "
        "survivor's state or the latest checkpoint) and running the cell again")
    _trained_on_after_recovery(result, ("hostA", "hostA"))
    after = {job: state for job, _, state in (j.split() for j in result["jobs_after_loss"] if len(j.split()) == 3)}
    assert after.get(job_of["hostA"]) == "RUNNING" and after.get(job_of["hostB"]) != "RUNNING", result["jobs_after_loss"]
    _nothing_left(hosts)


def test_slurm_without_hosts_starts_one_job_per_node_it_picks_and_replaces_a_lost_node_elsewhere(hosts, slurm_conf,
                                                                                                  tmp_path):
    """--launcher slurm -n 4 without --hosts: Slurm picks the nodes, one job a node, as many tasks
    as sinfo says a node has CPUs (2 here), each job taking its node whole (hostA, the kernel's
    host, is drained, so the jobs go to hostB and hostC). The last rank's node killed mid-cell with
    --auto-recover: named within 5 s, the other node's job and ranks kept, and a job for the lost
    ranks goes to the node made free meanwhile (hostA), never the lost one."""
    hosts.start_slurmd(["hostA", "hostB", "hostC"])  # an earlier test's lost host has no slurmd
    hosts.slurm("scontrol", "update", "nodename=hostA", "state=drain", "reason=kernel")
    driver = _start_driver(hosts, tmp_path, "slurm_picks", env={"SLURM_CONF": str(slurm_conf)})
    lost = None
    try:
        lost = _read_until(driver, "LOSE").split()[-1]
        hosts.slurm("scontrol", "update", "nodename=hostA", "state=resume")
        driver.stdin.write("go\n")
        driver.stdin.flush()
        _read_until(driver, "CELL STARTED")
        time.sleep(2.0)
        lost_at = time.time()
        hosts.kill_host(lost)
        result = _result(driver)
    finally:
        if driver.poll() is None:
            driver.kill()
        hosts.slurm("scontrol", "update", "nodename=hostA", "state=resume")
        if lost is not None:
            _restart_sshd(hosts, lost)
    noticed = result["failed_at"] - lost_at
    print(f"slurm without --hosts: 4 ranks in {result['start_s']:.1f} s: {result['jobs']}; {lost} killed: "
          f"auto-recover began after {noticed:.1f} s: {result['auto_notice']}; then {result['where_recovered']}")
    jobs = [job.split() for job in result["jobs"]]
    assert sorted(node for _, node, _ in jobs) == ["hostB", "hostC"] and all(s == "RUNNING" for *_, s in jobs), jobs
    job_of = {node: job for job, node, _ in jobs}
    first, second = result["where"][0][0], result["where"][2][0]
    assert {first, second} == {"hostB", "hostC"} and lost == second
    # a node's ranks are consecutive, one job of 2 tasks each, LOCAL_RANK and NODE_RANK as torchrun's
    assert [[w[0], w[2], w[3], w[4], w[5]] for w in result["where"]] == [
        [first, "0", "0", job_of[first], "2"], [first, "1", "0", job_of[first], "2"],
        [second, "0", "1", job_of[second], "2"], [second, "1", "1", job_of[second], "2"]]
    assert result["ddp_ranks_agree"] and result["trained_on"] and result["restore_exact"]
    assert noticed < 5.0, noticed
    assert result["auto_notice"].startswith(f"auto-recover 1/3: host {lost} lost (ranks 2,3): "), result["auto_notice"]
    assert "without the lost host's ranks" not in result["auto_notice"]
    _trained_on_after_recovery(result, (first, first, "hostA", "hostA"))  # from the survivors' live replica
    replaced = result["where_recovered"]
    assert replaced[0][4] == job_of[first] and replaced[2][4] == replaced[3][4] != job_of[lost], replaced
    after = {job: state for job, _, state in (j.split() for j in result["jobs_after_loss"] if len(j.split()) == 3)}
    assert after.get(job_of[first]) == "RUNNING" and after.get(job_of[lost]) != "RUNNING", result["jobs_after_loss"]
    _nothing_left(hosts)
