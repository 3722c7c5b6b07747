"""Where engines start: ipyparallel's own launchers (local, MPI, Slurm, PBS, SSH, and its others).

:class:`LauncherSpec` turns ``%fleet start --launcher NAME`` and its options
into the ``ipp.Cluster`` arguments and the traitlets config of that
launcher's engine-set class (``SlurmEngineSetLauncher.queue``, ...), so every
option ipyparallel knows passes through by name; ``--launcher-config FILE``
loads a traitlets config file (``c.SlurmEngineSetLauncher.timelimit = ...``). What differs
between launchers for a fleet is one table (:mod:`workbench.launcher_kinds`); what each one needs done
its own way (ssh's hosts, Slurm's sbatch flags) is here.
Each rank is its own engine set (one ``mpiexec -n 1``, one ssh command), so a rank
can be replaced or added alone; except with Slurm, where a node's ranks start
together as one job (``--nodes=1``, one task per rank: on the node ``--hosts`` names,
else on a node Slurm picks, ``--ranks-per-node`` or a node's GPUs or CPUs a job), so a
node comes up whole or not at all, a lost node ends only its own job, and a rank of it
is stopped alone through its nanny.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

from workbench.errors import OptionsError
from workbench.launcher_kinds import LOCAL, kind_of, launcher_names
from workbench.rank.template import exit_status, socket_path

SSH_PORT, SLURMD_PORT = 22, 6818  # what answers on a live host of each launcher (slurmd's default port)


@dataclass
class LauncherSpec:
    name: str = "local"
    options: dict = field(default_factory=dict)
    config_file: str | None = None
    per_node: int | None = None  # --ranks-per-node: Slurm without --hosts

    def __post_init__(self) -> None:
        if self.name not in launcher_names():
            raise OptionsError(f"unknown launcher {self.name!r}; use one of: {', '.join(launcher_names())}")
        self.kind = kind_of(self.name)
        if self.config_file is not None and not os.path.isfile(self.config_file):
            raise OptionsError(f"--launcher-config {self.config_file!r} is not a file")
        self.traits = {self._trait(key): value for key, value in self.options.items()}
        self.submit_command = ["sbatch"]  # Slurm's, as configured (configure)
        self.ssh_command = ["ssh"]  # the ssh launcher's, with its ssh_args (configure)

    @property
    def remote(self) -> bool:
        return self.kind.remote

    @property
    def local(self) -> bool:
        """Engines forked here from the engine template (no scheduler between)."""
        return self.name == LOCAL

    @functools.cached_property
    def probe_port(self) -> int | None:
        """The port a live host of this launcher answers on: sshd's (the ssh launcher started the
        engines through it) or slurmd's. A host whose ranks went silent is asked there whether it
        is still there (:meth:`EnginePool.lost_hosts_now`); None: hosts are not probed."""
        if self.kind.probe == "ssh":
            return SSH_PORT
        if self.kind.probe == "slurmd":
            return _slurmd_port()
        return None

    @property
    def node_jobs(self) -> bool:
        """A node's engines start together as one job of one task per rank (Slurm): the node
        comes up whole or not at all, and a node lost ends only its own job."""
        return self.kind.node_jobs

    @property
    def stops_engines(self) -> bool:
        """Its engines are stopped through the launcher, not asked to exit first: ipyparallel's ssh
        launcher signals them by pid on their host, and one that already exited prints a traceback."""
        return self.kind.stops_engines

    def launcher_class(self):
        from ipyparallel.cluster.launcher import find_launcher_class

        return find_launcher_class(self.name, "engine")

    def _trait(self, key: str) -> str:
        key = key.replace("-", "_")
        trait = self.kind.shortcuts.get(key, key)
        if self.local:
            raise OptionsError(f"--{key.replace('_', '-')} is an option of a cluster launcher; add --launcher "
                               "slurm|pbs|mpi|ssh")
        known = self.launcher_class().class_traits(config=True)
        if trait not in known:
            raise OptionsError(f"the {self.name} launcher has no option {key!r}; it knows: "
                               f"{', '.join(sorted(known))}")
        return trait

    def ranks_per_node(self) -> int:
        """How many ranks one node's job starts when Slurm picks the nodes: ``--ranks-per-node``,
        else what a node of the partition has (:func:`slurm_node_size`)."""
        return self.per_node if self.per_node is not None else slurm_node_size(self.traits.get("queue"))[0]

    def engine_set_kwargs(self, slots: list, avoid: list[str] = ()) -> dict:
        """Traits of the engine set of ``slots`` (one rank's, or one node's with Slurm): with
        ``--hosts``, the host its engines start on; ``avoid``: lost hosts Slurm must not pick."""
        host = slots[0].host
        if self.name == "ssh" and host is not None:
            # a shared filesystem: the connection files are already there (scp onto the same path would
            # truncate them)
            return {"engines": {host: {"n": 1, "to_send": []}}}
        if self.name == "slurm":
            # sbatch's own flags beside the batch script's: one node, the named one, or one Slurm picks
            # (never a lost one); a job of a node's size fills it, so the next job goes to another node
            where = [f"--nodelist={host}"] if host is not None else []
            if host is None and avoid:
                where.append(f"--exclude={','.join(sorted(avoid))}")
            if host is None and (gpus := slurm_node_size(self.traits.get("queue"))[1]):
                where.append(f"--gres=gpu:{min(gpus, len(slots))}")  # one GPU a task, as their local rank picks
            return {"submit_command": [*self.submit_command, "--nodes=1", *where]}
        return {}

    def fence(self, host: str, pids: list[int]) -> None:
        """Stop the engines ``pids`` left on ``host`` from before it was lost (it answers again):
        by ssh with the launcher's own ssh command. A Slurm node's job was cancelled when the node
        was lost; its slurmd ends the job's tasks as it comes back."""
        if self.name != "ssh" or not pids:
            return
        import subprocess

        try:
            subprocess.run([*self.ssh_command, host, "kill", "-KILL", *map(str, pids)], capture_output=True,
                           timeout=15, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass  # it ends with the controller's silence bound, and is never admitted again

    def pending_reason(self, engine_set) -> str | None:
        """Why the batch job of ``engine_set`` has not started (``PENDING (Resources)``), or None."""
        job_id = getattr(engine_set, "job_id", None)
        if self.name != "slurm" or not job_id:
            return None
        import subprocess

        try:
            out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T (%r)"], capture_output=True,
                                 text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None
        return f"Slurm job {job_id} {out}" if out else None

    def cluster_kwargs(self) -> dict:
        """Arguments for ``ipp.Cluster``: the engine launcher (local engines fork from the engine
        template, :mod:`workbench.rank.template`), and for engines on other hosts a controller that
        listens on the network (registration is still signed with the cluster's key)."""
        kwargs = {"engines": TemplateEngineSetLauncher} if self.local else {"engines": self.name}
        if self.remote:
            kwargs["controller_ip"] = "*"
        return kwargs

    def configure(self, cluster) -> None:
        """Put the options (and the config file) into ``cluster``'s config."""
        if self.config_file is not None:
            from traitlets.config.loader import PyFileConfigLoader

            folder, name = os.path.split(os.path.abspath(self.config_file))
            cluster.config.merge(PyFileConfigLoader(name, path=folder).load_config())
        section = self.launcher_class().__name__
        known = self.launcher_class().class_traits(config=True)
        traits = {trait: shlex.split(value) if isinstance(value, str) and type(known[trait]).__name__ == "List"
                  else value for trait, value in self.traits.items()}  # ssh_args='-i key -o BatchMode=yes'
        if self.name == "ssh":  # a shared filesystem: the same Python (venv) on every host; scp as ssh
            traits.setdefault("remote_python", sys.executable)
            if "ssh_args" in traits:
                traits.setdefault("scp_args", list(traits["ssh_args"]))
        for trait, value in traits.items():
            cluster.config[section][trait] = value
        if self.name == "slurm":
            self.submit_command = list(cluster.config[section].get("submit_command", ["sbatch"]))
        if self.name == "ssh":
            self.ssh_command = [*cluster.config[section].get("ssh_cmd", ["ssh"]),
                                *cluster.config[section].get("ssh_args", [])]

    def environment(self) -> dict:
        """Extra environment for the launcher: OpenMPI refuses root without these."""
        if self.name == "mpi" and os.geteuid() == 0:
            return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        return {}


@functools.cache
def slurm_node_size(partition: str | None) -> tuple[int, int]:
    """(ranks, GPUs) of a node of ``partition`` (the default one if None), from ``sinfo``: its
    GPUs (gres ``gpu:8``, ``gpu:a100:8(S:0-1)``), else its CPUs; the smallest node counts."""
    import subprocess

    argv = ["sinfo", "-h", "-N", "-o", "%c %G", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OptionsError(f"sinfo could not say how big a Slurm node is ({exc}); give --ranks-per-node K") from None
    sizes = []
    for line in out.splitlines():
        cpus, _, gres = line.partition(" ")
        gpus = sum(int(m) for m in re.findall(r"gpu(?::[\w.-]+)?:(\d+)", gres))
        if cpus.isdigit():
            sizes.append((gpus or int(cpus), gpus))
    if not sizes:
        raise OptionsError(f"sinfo lists no node{f' in partition {partition}' if partition else ''}; give "
                           "--ranks-per-node K")
    return min(sizes)


def _slurmd_port() -> int:
    """slurmd's port from Slurm's own configuration (``scontrol show config``), else its default."""
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return SLURMD_PORT
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "SlurmdPort" and value.strip().isdigit():
            return int(value.strip())
    return SLURMD_PORT


def parse_options(pairs: list[str]) -> dict:
    """``["partition=gpu", "time=01:00:00"]`` → a dict (values stay strings, except lists
    written as ``a,b`` for ``mpi_args``)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise OptionsError(f"--launcher-option takes KEY=VALUE, e.g. --launcher-option qos=high (got {pair!r})")
        options[key] = value.split() if key.replace("-", "_") == "mpi_args" else value
    return options


class TemplateEngineLauncher(LocalEngineLauncher):
    """One local engine, forked from the fleet's engine template (:mod:`workbench.rank.template`,
    listening in the runtime folder that holds the cluster's profile) once it is ready; a cold
    ``python -m ipyparallel.engine`` before that, or if the template is gone."""

    forked = False

    def _runtime_dir(self) -> str:
        return os.path.dirname(os.path.abspath(self.profile_dir))

    def start(self):
        path = socket_path(self._runtime_dir())
        if not os.path.exists(path):
            return super().start()
        request = {"argv": self.args, "env": {**os.environ, **self.get_env()}, "cwd": self.work_dir,
                   "output": self.output_file}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10)
                conn.connect(path)
                conn.sendall((json.dumps(request) + "\n").encode())
                pid = json.loads(conn.makefile("r").readline())["pid"]
        except (OSError, ValueError, KeyError) as exc:
            self.log.warning("engine template unavailable (%s); starting a cold engine", exc)
            return super().start()
        self.forked = True
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()

    def _wait(self):
        if not self.forked:
            return super()._wait()
        while not self._stop_waiting.is_set() and self.state == "running":
            try:
                self.process.wait(timeout=self.poll_seconds)
            except psutil.TimeoutExpired:
                continue
            break
        code = None  # not our child: the template reaps it and records how it ended
        deadline = time.monotonic() + 1.0
        while (code := exit_status(self._runtime_dir(), self.pid)) is None and time.monotonic() < deadline:
            time.sleep(0.025)
        stop_data = dict(exit_code=code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))


class TemplateEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine-set launcher, with engines forked from the engine template."""

    launcher_class = TemplateEngineLauncher
