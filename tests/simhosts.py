"""Simulated hosts for the cluster tests: network namespaces on a bridge, each with its own
hostname, hosts file and sshd (root, Linux; the facts are in ../shared/NOTES.md).

``SimulatedHosts(["hostA", "hostB"])`` builds:
- a namespace holding only a bridge (the machine's own namespace gets no address or route);
- per host a namespace joined to the bridge by a veth pair, an address 10.231.N.x/24, its own
  ``/etc/netns/<ns>/hosts`` naming every host, and an sshd that accepts one test key for root;
- :meth:`run` starts a process "on" a host: in its namespace, under its own UTS hostname;
- :meth:`shape` limits a host's link with ``tc tbf``; :meth:`cut` takes it down (a partition);
- :meth:`kill_host` kills every process of a host (its sshd too): the host died;
- :meth:`start_slurm` runs Slurm on them: slurmctld on the first host, a slurmd per host
  (each in its host's namespace, with the cgroup v1 hierarchies slurmd wants mounted there).
Everything goes away in :meth:`close` (also after a failure): processes, namespaces, files.
Traffic flows only between these namespaces. The filesystem is shared, as on a cluster with a
shared home (the same venv and run folder on every host).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
SLURM_CONF = """ClusterName=workbench-test
SlurmctldHost={controller}
{ports}AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ReturnToService=2
MpiDefault=none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe={oversubscribe}
"""


def slurm_conf(folder, controller: str, nodes: dict[str, str | None], ports: tuple[int, int] | None = None,
               cpus: int | None = None, oversubscribe: str = "FORCE") -> str:
    """slurm.conf of a test cluster (also tests/test_launchers.py's on this machine): ``controller``
    (``host`` or ``host(address)``) runs slurmctld; each of ``nodes`` (name -> address, or None to
    resolve the name) a slurmd with ``cpus`` CPUs (default this machine's); state, spool, pid and
    log files under ``folder``; ``ports``: slurmctld's and slurmd's (default: Slurm's own);
    ``oversubscribe``: the partition's (FORCE: jobs share CPUs, NO: a full node takes no job)."""
    cpus = cpus or os.cpu_count() or 1
    lines = [f"NodeName={name}{f' NodeAddr={address}' if address else ''} CPUs={cpus} State=UNKNOWN"
             for name, address in nodes.items()]
    port_lines = f"SlurmctldPort={ports[0]}\nSlurmdPort={ports[1]}\n" if ports else ""
    return SLURM_CONF.format(controller=controller, ports=port_lines, dir=folder, nodes="\n".join(lines),
                             oversubscribe=oversubscribe)


# slurmd wants the cgroup v1 hierarchies; `ip netns exec` remounts /sys, so they are mounted again in there
CGROUPS = ("mount -t tmpfs none /sys/fs/cgroup && for c in cpu cpuacct cpuset memory devices freezer blkio pids; "
           "do mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c $c /sys/fs/cgroup/$c; done && "
           "mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd systemd /sys/fs/cgroup/systemd "
           '&& exec "$@"')


def can_simulate() -> str | None:
    """None when namespaces, veth pairs and sshd are available here, else why not (one line)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool}"
    if not os.path.exists(SSHD):
        return "simulated hosts need sshd: apt-get install -y openssh-server"
    probe = f"wbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces cannot be made here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def cmdline(pid: int, gone: str = "") -> str:
    """The command line of process ``pid`` (``gone`` if it ended meanwhile)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return gone


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


class SimulatedHosts:
    def __init__(self, names: list[str], subnet: int | None = None) -> None:
        self.names = list(names)
        self.tag = f"{os.getpid() % 10000}"
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 100
        self.addresses = {name: f"10.231.{self.subnet}.{i + 2}" for i, name in enumerate(self.names)}
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix="wb-hosts-"))
        self.key = self.folder / "id_ed25519"
        self._switch = f"wbsw{self.tag}"
        self._sshd: dict[str, subprocess.Popen] = {}
        self._made: list[str] = []  # namespaces made so far
        self.slurm_conf: pathlib.Path | None = None  # set by start_slurm
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return f"wb{self.names.index(host)}h{self.tag}"

    def _veth(self, host: str) -> tuple[str, str]:
        i = self.names.index(host)
        return f"wb{i}a{self.tag}", f"wb{i}b{self.tag}"  # the host's end, the bridge's end

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        _sh("ip", "netns", "add", self._switch)
        self._made.append(self._switch)
        _sh("ip", "-n", self._switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self._switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in self.addresses.items())
        for host in self.names:
            ns = self.namespace(host)
            pathlib.Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            pathlib.Path(f"/etc/netns/{ns}/hosts").write_text(hosts_file)
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            mine, bridge = self._veth(host)
            _sh("ip", "link", "add", mine, "netns", ns, "type", "veth", "peer", "name", bridge, "netns", self._switch)
            _sh("ip", "-n", self._switch, "link", "set", bridge, "master", "br0")
            _sh("ip", "-n", self._switch, "link", "set", bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", mine)
            _sh("ip", "-n", ns, "link", "set", mine, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        (self.folder / "authorized_keys").write_text((self.folder / "id_ed25519.pub").read_text())
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "host_key"))
        os.chmod(self.folder, 0o700)
        for host in self.names:
            self._start_sshd(host)
        for host in self.names:
            self._wait_ssh(host)

    def _start_sshd(self, host: str) -> None:
        config = self.folder / f"sshd-{host}.conf"
        config.write_text(
            f"ListenAddress {self.addresses[host]}\nPort 22\nHostKey {self.folder / 'host_key'}\n"
            f"PidFile {self.folder / f'sshd-{host}.pid'}\nAuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\n"
            "AcceptEnv *\nPermitUserEnvironment yes\nMaxStartups 100\nMaxSessions 100\nLogLevel ERROR\n"
            "Subsystem sftp internal-sftp\n")
        pathlib.Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
        self._sshd[host] = self.run(host, [SSHD, "-D", "-e", "-f", str(config)],
                                    stdout=subprocess.DEVNULL, stderr=open(self.folder / f"sshd-{host}.log", "w"))

    def _wait_ssh(self, host: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(["ip", "netns", "exec", self.namespace(self.names[0]), *self.ssh_command(host),
                                   "true"], capture_output=True, text=True)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host} did not answer: {done.stderr.strip()}")
            time.sleep(0.2)

    # ------------------------------------------------------------------ using
    @property
    def ssh_args(self) -> list[str]:
        """What ssh needs to reach every host without a prompt (ipyparallel's ``ssh_args``)."""
        return ["-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5"]

    def ssh_command(self, host: str) -> list[str]:
        return ["ssh", *self.ssh_args, host]

    def run(self, host: str, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (its namespace and hostname)."""
        wrapped = ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "sh", "-c",
                   f'hostname {host} && exec "$@"', "sh", *argv]
        return subprocess.Popen(wrapped, **popen)

    def shape(self, host: str, rate: str) -> None:
        """Limit ``host``'s link to ``rate`` (``50mbit``) each way out of the host."""
        mine, bridge = self._veth(host)
        for ns, dev in ((self.namespace(host), mine), (self._switch, bridge)):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "32kbit", "latency", "50ms")

    def unshape(self, host: str) -> None:
        mine, bridge = self._veth(host)
        for ns, dev in ((self.namespace(host), mine), (self._switch, bridge)):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def cut(self, host: str) -> None:
        """A partition: ``host``'s link goes down; its processes live on."""
        _sh("ip", "-n", self._switch, "link", "set", self._veth(host)[1], "down")

    def mend(self, host: str) -> None:
        _sh("ip", "-n", self._switch, "link", "set", self._veth(host)[1], "up")

    def pids(self, host: str) -> list[int]:
        done = _sh("ip", "netns", "pids", self.namespace(host), check=False)
        return [int(p) for p in done.stdout.split()]

    def kill_host(self, host: str) -> None:
        """Every process of ``host`` killed at once (SIGKILL), as when the machine dies."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def start_slurm(self, nodes: list[str] | None = None, timeout: float = 60.0) -> pathlib.Path:
        """Slurm over these hosts: munged (here; its socket is on the shared filesystem), slurmctld
        on the first host, slurmd on each of ``nodes`` (default all hosts; a host left out is a
        node that never comes up). Returns the slurm.conf path (``SLURM_CONF`` for clients)."""
        missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"Slurm needs {', '.join(missing)}: apt-get install -y slurm-wlm munge")
        nodes = list(self.names if nodes is None else nodes)
        folder = self.folder / "slurm"
        for sub in ["state", *(f"spool-{host}" for host in self.names)]:
            (folder / sub).mkdir(parents=True)
        self.slurm_conf = folder / "slurm.conf"
        self.slurm_conf.write_text(slurm_conf(folder, f"{self.names[0]}({self.addresses[self.names[0]]})",
                                              dict(self.addresses), cpus=2, oversubscribe="NO"))  # 2 ranks fill a node
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        _sh("munged", "--force", "-S", str(folder / "munge.sock"), f"--key-file={key}",
            f"--log-file={folder / 'munged.log'}", f"--pid-file={folder / 'munged.pid'}",
            f"--seed-file={folder / 'munged.seed'}")
        with open(folder / "daemons.log", "w") as log:
            self.run(self.names[0], ["slurmctld", "-D"], env=self._slurm_env(), stdout=log, stderr=log)
        self.start_slurmd(nodes, timeout)
        return self.slurm_conf

    def _slurm_env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def slurm(self, *argv: str) -> str:
        """A Slurm client command (``scontrol``, ``sinfo``) on the first host; its stdout."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(self.names[0]), *argv], capture_output=True,
                              text=True, env=self._slurm_env()).stdout

    def start_slurmd(self, nodes: list[str], timeout: float = 60.0) -> None:
        """slurmd on each of ``nodes`` where none runs (a killed host's is gone); returns once
        Slurm calls them all idle."""
        folder = self.slurm_conf.parent
        with open(folder / "daemons.log", "a") as log:
            for host in nodes:
                if not any("slurmd" in cmdline(pid) for pid in self.pids(host)):
                    self.run(host, ["sh", "-c", CGROUPS, "sh", "slurmd", "-D", "-N", host], env=self._slurm_env(),
                             stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            out = self.slurm("sinfo", "-h", "-N", "-o", "%N %T")
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(host) == "idle" for host in nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {states} "
                                   f"{(folder / 'daemons.log').read_text()[-1000:]}")
            time.sleep(0.5)

    def close(self) -> None:
        for host in self.names:
            if self.namespace(host) in self._made:
                self.kill_host(host)
        for proc in self._sshd.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in reversed(self._made):
            _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made = []
        if self.slurm_conf is not None:
            munge = self.slurm_conf.parent / "munge.sock"
            _sh("munged", "-s", "-S", str(munge), check=False)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "SimulatedHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
