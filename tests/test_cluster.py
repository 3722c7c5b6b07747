"""Fleets across hosts, on hosts simulated here (tests/simhosts.py: network namespaces on a
bridge, each with its own hostname and sshd; root only, skipped elsewhere with one line).
The kernel runs on hostA (tests/cluster_driver.py); ``--hosts`` places the ranks through
ipyparallel's ssh launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from simhosts import SimulatedHosts, can_simulate

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
    with pytest.raises(OptionsError, match="place engines with --launcher ssh"):
        FleetOptions(n=2, hosts="a:2").validate()
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
    """Processes on ``host`` other than its sshd listener."""
    return [p for p in hosts.pids(host) if "sshd" not in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")]


def _start_driver(hosts, tmp_path, *args: str) -> subprocess.Popen:
    """tests/cluster_driver.py on hostA (the kernel's host)."""
    return hosts.run("hostA", [sys.executable, os.path.join(HERE, "cluster_driver.py"), args[0],
                               " ".join(hosts.ssh_args), *args[1:]],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)


def _result(driver: subprocess.Popen) -> dict:
    """The driver's JSON line, once it ended (killed after 300 s)."""
    try:
        out, err = driver.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        driver.kill()
        out, err = driver.communicate()
    assert driver.returncode == 0, err[-3000:]
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
    # nothing of the fleet outlives it, on any host
    deadline = time.monotonic() + 15
    while any(_others(hosts, h) for h in hosts.names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_others(hosts, h) for h in hosts.names), {h: _others(hosts, h) for h in hosts.names}


def _lose_host_mid_cell(hosts, tmp_path, lose, come_back) -> tuple[dict, float]:
    """hostC (rank 2 of 3) is lost (``lose``) two seconds into a training cell; then it comes back
    for the tests after this one. Returns the driver's result and the seconds until the cell failed."""
    driver = _start_driver(hosts, tmp_path, "host_loss", "hostA:1,hostB:1,hostC:1", "3")
    try:
        for line in driver.stdout:
            if "CELL STARTED" in line:
                break
        time.sleep(2.0)  # a few steps in
        lost_at = time.time()
        lose("hostC")
        result = _result(driver)
    finally:
        come_back()
    return result, result["failed_at"] - lost_at


def _went_on_without_it(result: dict) -> None:
    """recover --shrink: the 2 survivors from their live replica (the steps trained before and in
    the failed cell), then training goes on."""
    assert result["ranks_after"] == 2 and [w[0] for w in result["where_after"]] == ["hostA", "hostB"]
    assert result["survivors_agree"] and result["trains_on"]
    steps = result["step_after_recover"]
    assert steps[0] == steps[1] > 5, steps
    assert result["step_after_training"] == [steps[0] + 5] * 2


def _restart_sshd(hosts, host):
    hosts._start_sshd(host)
    hosts._wait_ssh(host)


def test_a_killed_host_is_named_in_seconds_and_the_others_keep_their_state(hosts, tmp_path):
    """Every process of hostC killed mid-cell (the machine died): the cell fails within 5 s naming
    the host; the healthy ranks are not killed; recover --shrink goes on from their live replica."""
    result, noticed = _lose_host_mid_cell(hosts, tmp_path, hosts.kill_host, lambda: _restart_sshd(hosts, "hostC"))
    print(f"hostC killed: the cell failed after {noticed:.1f} s: {result['error']}; recover --shrink "
          f"{result['recover_s']:.1f} s")
    assert noticed < 5.0, noticed
    assert result["error"] == ("DistributedCellError: host hostC lost (ranks 2): its ranks went silent and the host "
                               "refuses connections (its processes are gone); the other ranks failed because of it")
    assert "The other ranks keep their state" in result["notes"]
    assert result["recover_error"] == ("OptionsError: rank 2 ran on hostC, which is lost, and no other host has a free "
                                       "slot: %fleet recover --shrink goes on without them (then %fleet scale N "
                                       "--hosts HOST:K adds a host)")
    _went_on_without_it(result)


def test_a_cut_off_host_is_named_and_the_others_collectives_end_with_their_state(hosts, tmp_path):
    """hostC's link goes down mid-cell (its processes live on): named 'unreachable' within 10 s; the
    other ranks, blocked in a collective with it, are released by cutting their links to it (not
    killed, not left until --pg-timeout); recover --shrink goes on from their live replica."""
    def come_back():
        hosts.mend("hostC")
        hosts.kill_host("hostC")  # its stale engine (fenced: never admitted again)
        _restart_sshd(hosts, "hostC")

    result, noticed = _lose_host_mid_cell(hosts, tmp_path, hosts.cut, come_back)
    print(f"hostC cut off: the cell failed after {noticed:.1f} s: {result['error']}; recover --shrink "
          f"{result['recover_s']:.1f} s")
    assert noticed < 10.0, noticed
    assert result["error"] == ("DistributedCellError: host hostC unreachable (ranks 2): its ranks went silent and the "
                               "host does not answer on the network (a partition, or the machine is down); the other "
                               "ranks failed because of it")
    assert result["recover_s"] < 30, "the survivors' collective ended when their links to hostC were cut"
    _went_on_without_it(result)


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
