"""The engine fleet: an ipyparallel cluster with one engine per rank (per GPU).

Each rank is its own ipyparallel engine set, so that every engine gets its own
environment (``CUDA_VISIBLE_DEVICES`` with exactly one GPU) and can be stopped
or replaced alone. Local engines fork from the engine template
(:mod:`workbench.template`), so a new one is ready in about a second.
``spares=K`` keeps K more engines started and warm, not in the process group:
scaling up and replacing a dead rank take one instead of starting an engine,
and a new spare is started in the background.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from . import engine, execution, rendezvous, template
from .checkpoint.control import Checkpoints
from .devices import EngineSlot, parse_gpu_list, plan_engines
from .errors import FleetError, OptionsError
from .launchers import LauncherSpec, parse_size
from .metrics.live import FleetMetrics
from .output import ProgressLine
from .ranklogs import RankLogs
from .reaper import write_pids
from .runs import new_run_dir
from .strategies import CellOptions
from .watchdog import DEFAULT_HANG_TIMEOUT_S

DEFAULT_PG_TIMEOUT_S = 300.0
DEFAULT_ENGINE_TIMEOUT_S = 120.0
# The hub pings engines every HUB_HEARTBEAT_PERIOD_MS; a new engine counts as registered at the first
# ping it answers, one or two periods after it started (ipyparallel's 3 s period made every new engine wait
# up to 6 s for that; 500 ms cost 0.5-1 s of every rescale; a ping is a few bytes, answered in C). The hub
# unregisters an engine silent for HUB_HEARTBEAT_MISSES periods, 120 s (ipyparallel's 30 s
# unregistered live engines of a 2-core machine at load 18); a local engine counts as dead only
# once its process is gone, so this bounds how long a silent engine on another host takes
HUB_HEARTBEAT_PERIOD_MS = 100
HUB_SILENT_S = 120
HUB_HEARTBEAT_MISSES = HUB_SILENT_S * 1000 // HUB_HEARTBEAT_PERIOD_MS
EXIT_GRACE_S = 5.0
CONTROLLER_TIMEOUT_S = 5.0
EXIT_STATUS_WAIT_S = 0.5  # how long a death report waits for the launcher to say how the engine ended  # a status query the controller does not answer in this long fails  # an engine whose launcher says it exited gets this long to show up registered
BACKENDS = ("gloo", "nccl", "mpi")


@dataclass
class Member:
    """One rank of the fleet and the engine that runs it."""

    rank: int
    slot: EngineSlot
    engine_id: int
    pid: int
    host: str
    engine_set: str
    device: str = "cpu"


class Fleet:
    """A set of ipyparallel engines joined in one torch.distributed process group.

    >>> with Fleet(n=2) as fleet:
    ...     fleet.run("import torch; t = torch.ones(1); torch.distributed.all_reduce(t); t.item()")
    [2.0, 2.0]
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        gpus: str | list[str] | None = None,
        cpu: bool = False,
        backend: str | None = None,
        pg_timeout: float = DEFAULT_PG_TIMEOUT_S,
        engine_timeout: float = DEFAULT_ENGINE_TIMEOUT_S,
        progress: bool = True,
        runs_dir: str | None = None,
        wandb: bool | None = None,
        tensorboard: bool | None = None,
        auto_recover: bool = False,
        max_restarts: int = 3,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S,
        spares: int = 0,
        launcher: str = "local",
        launcher_options: dict | None = None,
        launcher_config: str | None = None,
        profile: str | None = None,
        cluster_id: str | None = None,
        memory_limit: str | int | None = None,
    ) -> None:
        if isinstance(gpus, str):
            gpus = parse_gpu_list(gpus)
        self.launcher = LauncherSpec(launcher, dict(launcher_options or {}), launcher_config)
        self.profile, self.cluster_id = profile, cluster_id
        self.attached = profile is not None or cluster_id is not None  # an ipcluster that is not ours
        if self.launcher.name != "local" or self.attached:
            if gpus:
                raise OptionsError("--gpus picks GPUs of this machine; with a cluster launcher the scheduler "
                                   "assigns them (each engine takes the GPU of its local rank)")
            if n is None and not self.attached:
                raise OptionsError(f"--launcher {launcher} needs -n (how many engines to start)")
            self._slots = [EngineSlot(i) for i in range(n or 0)]
            self.device_type = "cuda" if backend == "nccl" else "cpu"
        else:
            self._slots = plan_engines(n, gpus, cpu=cpu)
            self.device_type = self._slots[0].device_type
            if self.device_type == "cpu":
                _check_machine_fits(len(self._slots))
        self.memory_limit = parse_size(memory_limit)
        # extra environment of the engine of a slot: e.g. WORKBENCH_HOSTNAME to simulate nodes in tests
        self.slot_environment: dict[int, dict[str, str]] = {}
        if backend is not None and backend not in BACKENDS and ":" not in backend:
            raise OptionsError(f"unknown backend {backend!r}; use one of: {', '.join(BACKENDS)}")
        self.backend = backend or ("nccl" if self.device_type == "cuda" else "gloo")
        if pg_timeout <= 0:
            raise OptionsError(f"--pg-timeout must be a positive number of seconds (got {pg_timeout})")
        self.pg_timeout = float(pg_timeout)
        self.engine_timeout = float(engine_timeout)
        self.progress = progress
        self.runs_dir = runs_dir
        self.wandb = wandb
        self.tensorboard = tensorboard
        self.run_id: str | None = None
        self.run_dir: str | None = None
        self.metrics: FleetMetrics | None = None
        self.rank_logs: RankLogs | None = None  # <run>/logs: each rank's output, each engine's own
        self.checkpoints = Checkpoints(self)
        self.setup_cells: list[tuple[str, CellOptions]] = []  # replayed after scale / recovery
        self.training_cell: tuple[str, CellOptions] | None = None  # the last other cell run on every rank
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise OptionsError(f"--max-restarts must be a whole number >= 0 (got {max_restarts!r})")
        self.auto_recover = auto_recover
        self.max_restarts = max_restarts
        if hang_timeout is not None and hang_timeout < 0:
            raise OptionsError(f"--hang-timeout must be >= 0 seconds, 0 to turn it off (got {hang_timeout})")
        self.hang_timeout = hang_timeout or None  # a rank without heartbeat or progress this long is hung
        self.restarts = 0
        self.fresh_ranks: list[int] = []  # replaced after dying, not set up again yet: cells wait for recover
        self.replaying = False  # recover/scale replaying the setup cells (runs on fresh ranks too)
        self.members: list[Member] = []
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise OptionsError(f"--spares must be a whole number >= 0 (got {spares!r})")
        self.spares_wanted = spares
        self.spares: list[Member] = []  # warm engines outside the process group (rank -1)
        self._pending_spares: dict[str, EngineSlot] = {}  # engine set -> slot, not registered yet
        self._identities: dict[int, dict] = {}  # engine id -> rendezvous.identify()
        self._dead_engines: set[int] = set()  # replaced engines (the hub may list a dead one for a while)
        self.generation = 0
        self.runtime_dir: str | None = None
        self.client = None
        self._views: tuple = (None, {})  # (client, {engine id: its view}): see view()
        self._cluster = None
        self._reaper: subprocess.Popen | None = None
        self._template: subprocess.Popen | None = None  # the process local engines fork from
        self._cells = 0
        self._set_counter = 0

    # ------------------------------------------------------------------ life cycle
    @property
    def running(self) -> bool:
        return self.client is not None and bool(self.members)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def start(self) -> "Fleet":
        """Start the controller and engines, then join them in a process group."""
        if self.running:
            raise FleetError("this fleet is already running; use it, or stop it first with %fleet stop")
        import ipyparallel as ipp

        started = time.monotonic()
        progress = ProgressLine(self.progress)
        try:
            self.runtime_dir = tempfile.mkdtemp(prefix="workbench-")  # mode 0700
            self.run_id, self.run_dir = new_run_dir(self.runs_dir)
            self.rank_logs = RankLogs(self.run_dir)
            self.metrics = FleetMetrics(
                self.run_id, self.run_dir, self.runtime_dir, lambda: self.world_size,
                {"ranks": len(self._slots), "backend": self.backend, "device_type": self.device_type},
                wandb=self.wandb, tensorboard=self.tensorboard,
            )
            if self.attached:
                progress.show("fleet: connecting to the running cluster…")
                self._attach()
            else:
                progress.show(f"fleet: starting controller ({self.launcher.name} engines)…")
                kwargs = self.launcher.cluster_kwargs()
                kwargs["controller_args"] = [*kwargs.get("controller_args", ()),
                                             f"--HeartMonitor.period={HUB_HEARTBEAT_PERIOD_MS}",
                                             f"--HeartMonitor.max_heartmonitor_misses={HUB_HEARTBEAT_MISSES}"]
                self._cluster = ipp.Cluster(
                    profile_dir=os.path.join(self.runtime_dir, "profile"),
                    log_level=logging.ERROR,  # start-up failures are reported by us
                    engine_timeout=self.engine_timeout,
                    **kwargs,
                )
                self.launcher.configure(self._cluster)
                self._cluster.start_controller_sync()
                self._start_reaper()
                self._start_template()
                self._record_pids()
                if self.launcher.name == "local":
                    self._wait_for_template(progress, started)
                sets = {self._launch(slot): slot for slot in self._slots}
                self.client = self._cluster.connect_client_sync()
                self._wait_for_engines(sets, progress, started)
                self._map_members(sets)
            self._launch_spares(self.spares_wanted)
            progress.show(f"fleet: {len(self.members)} engines up; joining process group ({self.backend})…")
            self.rendezvous()
            self.fresh_ranks = []  # an engine replaced while starting: no rank has state yet
        except OSError as exc:  # no room for the runtime folder, no free port, ...
            self.stop()
            where = f" ({exc.filename})" if exc.filename else ""
            raise FleetError(f"the fleet could not start: {exc.strerror or exc}{where}") from exc
        except BaseException:
            self.stop()
            raise
        devices = ", ".join(m.device for m in self.members)
        progress.show(
            f"fleet: {self.world_size} ranks ready in {time.monotonic() - started:.1f} s "
            f"({self.backend}; devices: {devices})"
        )
        return self

    def stop(self) -> None:
        """Stop every engine and the controller; nothing is left running."""
        client, cluster = self.client, self._cluster
        pids = {m.pid for m in self.members + self.spares}
        processes = _process_trees([m.pid for m in self.members + self.spares if not self.attached])
        if self.attached:  # the cluster is the user's: leave its engines and controller running
            self._detach()
            client, cluster = None, None
        self.client, self._cluster, self.members, self.spares = None, None, [], []
        self._pending_spares, self._identities, self._dead_engines = {}, {}, set()
        if self.metrics is not None:
            self.metrics.close()  # the records stay readable in fleet.metrics.store
        if client is not None:
            try:  # engines that exit by themselves exit cleanly (and quietly); no wait on the controller,
                client.shutdown(targets="all", hub=False, block=False)  # which may be dead or frozen
            except Exception:
                pass
            psutil.wait_procs([p for p in processes if p.pid in pids], timeout=5)
            try:
                client.close()
            except Exception:
                pass
        if cluster is not None:
            if self.rank_logs is not None:
                for set_id in list(cluster.engines):
                    self.rank_logs.engine(set_id, self._engine_log(set_id, cluster))
            try:
                cluster.stop_cluster_sync()
            except Exception:
                pass
        if self.runtime_dir:
            from .reaper import kill_all

            kill_all(self.runtime_dir)  # anything that ignored SIGTERM; removes the folder
            self.runtime_dir = None
        _, alive = psutil.wait_procs(processes, timeout=5)  # engines' nannies exit after them
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        if self._template is not None:
            self._template.kill()
            self._template.wait()
            self._template = None
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None

    def __enter__(self) -> "Fleet":
        return self.start() if not self.running else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{self.world_size} ranks, {self.backend}" if self.running else "stopped"
        return f"<workbench.Fleet {state}>"

    # ------------------------------------------------------------------ engines
    def _launch(self, slot: EngineSlot) -> str:
        env = {
            **self.launcher.environment(),
            "WORKBENCH_SLOT": str(slot.slot),
            "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(self._slots)))
            ),
            "PYTHONUNBUFFERED": "1",
        }
        if slot.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot.gpu
        env.update(self.slot_environment.get(slot.slot, {}))
        self._set_counter += 1
        set_id = f"slot{slot.slot}-{self._set_counter}"
        self._cluster.start_engines_sync(n=1, engine_set_id=set_id, environment=env)
        self._record_pids()  # before it registers: a kill of the kernel now must not orphan it
        return set_id

    def _engine_log(self, set_id: str, cluster=None) -> str:
        """An engine set's process output (``cluster``: this fleet's, also while it stops)."""
        cluster = cluster if cluster is not None else self._cluster
        engine_set = cluster.engines.get(set_id) if cluster is not None else None
        try:
            return engine_set.get_output() if engine_set else ""
        except Exception:
            return ""

    def _stop_engine_set(self, set_id: str) -> None:
        """Stop one engine set, keeping its process's own output in the run's logs/."""
        if self.rank_logs is not None:
            self.rank_logs.engine(set_id, self._engine_log(set_id))
        try:
            self._cluster.stop_engines_sync(set_id)
        except Exception:
            pass

    def _identify_new(self) -> None:
        """Ask engines that registered since the last call who they are (slot, pid, host)."""
        new = [e for e in self.client.ids if e not in self._identities]
        if new:
            self._identities.update(zip(new, self.client[new].apply_sync(rendezvous.identify), strict=True))

    def _unassigned(self) -> dict[int, tuple[int, dict]]:
        """Registered engines that are neither a rank nor a spare, by launch slot."""
        taken = {m.engine_id for m in self.members + self.spares} | self._dead_engines
        alive = set(self.client.ids)
        return {info["slot"]: (e, info) for e, info in self._identities.items() if e in alive and e not in taken}

    def _wait_for_engines(self, sets: dict[str, EngineSlot], progress: ProgressLine, started: float) -> None:
        deadline = time.monotonic() + self.engine_timeout
        exited: dict[int, float] = {}  # slot -> when its launcher first said the engine exited
        while True:
            self._identify_new()
            up = set(self._unassigned())
            if all(slot.slot in up for slot in sets.values()):
                return
            for set_id, slot in sets.items():
                launcher = self._cluster.engines.get(set_id)
                if slot.slot not in up and launcher is not None and launcher.stop_data:
                    # the launcher can report an exit while the engine's registration is still reaching
                    # this client (seen on a loaded machine: "Completed registration" as its last line)
                    exited.setdefault(slot.slot, time.monotonic())
                    if time.monotonic() - exited[slot.slot] < EXIT_GRACE_S:
                        continue
                    log = self._engine_log(set_id).strip().splitlines()
                    last = log[-1] if log else "no output"
                    raise FleetError(f"the engine for rank slot {slot.slot} exited while starting: {last}")
            count = sum(slot.slot in up for slot in sets.values())
            if time.monotonic() > deadline:
                raise FleetError(
                    f"only {count} of {len(sets)} engines registered within {self.engine_timeout:.0f} s; "
                    "the machine may be overloaded: try again, or pass a larger engine_timeout"
                )
            progress.show(f"fleet: starting engines {count}/{len(sets)} ({time.monotonic() - started:.0f} s)…",
                          key=count)
            time.sleep(0.1)

    def _map_members(self, sets: dict[str, EngineSlot]) -> None:
        """Match new engines to their slots and give every engine its rank (slot order)."""
        unassigned = self._unassigned()
        new_ids = []
        for set_id, slot in sets.items():
            if slot.slot not in unassigned:  # it registered, then died before it got its rank
                raise FleetError(f"the engine for rank slot {slot.slot} exited right after starting; try again")
            engine_id, info = unassigned[slot.slot]
            self.members.append(Member(-1, slot, engine_id, info["pid"], info["host"], set_id))
            new_ids.append(engine_id)
        self._renumber()
        self._attach_engines(new_ids)

    def _attach_engines(self, engine_ids: list[int]) -> None:
        """New engines join the run: metrics to the collector, checkpoints under the run, memory limit."""
        self.client[engine_ids].apply_sync(engine.attach, self.metrics.address, self.run_dir, self.memory_limit,
                                           self.device_type == "cpu")

    def _renumber(self) -> None:
        """Ranks in slot order, grouped by host (a host's ranks are consecutive, as torchrun numbers them)."""
        first_slot: dict[str, int] = {}
        for member in self.members:
            first_slot[member.host] = min(first_slot.get(member.host, member.slot.slot), member.slot.slot)
        self.members.sort(key=lambda m: (first_slot[m.host], m.slot.slot))
        for rank, member in enumerate(self.members):
            member.rank = rank
        self._record_pids()

    # ------------------------------------------------------------------ spares
    def _launch_spares(self, count: int) -> None:
        """Start ``count`` spare engines in the background (as many as free GPUs allow)."""
        from .elastic import new_slots

        if count <= 0:
            return
        try:
            slots = new_slots(self, count)
        except OptionsError as exc:
            print(f"workbench: no spare engine started: {exc}", file=sys.stderr)
            return
        for slot in slots:
            self._pending_spares[self._launch(slot)] = slot
        self._record_pids()

    def _adopt_spares(self) -> None:
        """Take spare engines that have registered since; drop spares that died."""
        if not self._pending_spares and not self.spares:
            return
        self._identify_new()
        alive = set(self.client.ids)
        self.spares = [m for m in self.spares if m.engine_id in alive]
        unassigned = self._unassigned()
        adopted = []
        for set_id, slot in list(self._pending_spares.items()):
            if slot.slot in unassigned:
                engine_id, info = unassigned[slot.slot]
                self.spares.append(Member(-1, slot, engine_id, info["pid"], info["host"], set_id))
                adopted.append(engine_id)
                del self._pending_spares[set_id]
        if adopted:
            self._record_pids()
            self._attach_engines(adopted)
            self.client[adopted].apply_async(engine.warm)

    def _take_spares(self, slots: list[EngineSlot]) -> list[EngineSlot]:
        """Give ``slots`` to warm spares where there are some; return the slots left over."""
        self._adopt_spares()
        taken = 0
        while slots and self.spares:
            spare, slot = self.spares.pop(0), slots[0]
            slots = slots[1:]
            spare.slot = EngineSlot(slot.slot, spare.slot.gpu)  # the rank's place; the spare's own GPU
            self.members.append(spare)
            taken += 1
        if taken:
            self._renumber()
            self._launch_spares(taken)
        return slots

    def _attach(self) -> None:
        """Use the engines of an ipcluster that is already running (``--profile`` / ``--cluster-id``)."""
        import ipyparallel as ipp

        try:
            self._cluster = ipp.Cluster.from_file(profile=self.profile or "default", cluster_id=self.cluster_id or "")
        except Exception as exc:
            raise FleetError(f"no running cluster for profile {self.profile or 'default'!r} and cluster id "
                             f"{self.cluster_id or ''!r} ({_one_line(exc)}); start one with ipcluster start") from None
        self.client = self._cluster.connect_client_sync()
        # without -n: every engine the cluster was started with (a daemonized ipcluster returns
        # before they all register), else those registered by the deadline
        started = sum(getattr(s, "n", 0) or 0 for s in self._cluster.engines.values()) or self._cluster.n or 1
        wanted = len(self._slots) or started
        deadline = time.monotonic() + self.engine_timeout
        while len(self.client.ids) < wanted:
            if time.monotonic() > deadline:
                if self._slots or not self.client.ids:
                    raise FleetError(f"the cluster has {len(self.client.ids)} engines registered, fewer than asked")
                print(f"fleet: {len(self.client.ids)} of the cluster's {started} engines registered in "
                      f"{self.engine_timeout:g} s; using those", file=sys.stderr)
                break
            time.sleep(0.1)
        self._identify_new()
        ids = sorted(self._identities)[: len(self._slots) or None]
        for i, engine_id in enumerate(ids):
            info = self._identities[engine_id]
            self.members.append(Member(-1, EngineSlot(i), engine_id, info["pid"], info["host"], ""))
        self._renumber()
        self._attach_engines(ids)

    def _detach(self) -> None:
        try:
            self.client[self.engine_ids()].apply_sync(rendezvous.leave)
        except Exception:
            pass
        try:
            self.client.close()
        except Exception:
            pass

    def _record_pids(self) -> None:
        """Tell the reaper every process of this fleet, also those not registered yet (a start or
        scale half done) and the controller's scheduler children (orphaned if it is killed)."""
        if self.attached:
            return  # not ours to kill
        pids = [m.pid for m in self.members + self.spares]
        if self._template is not None:
            pids.append(self._template.pid)
        engine_sets = self._cluster.engines.values() if self._cluster is not None else ()
        for engine_set in engine_sets:  # the processes the launchers started, registered or not
            pids += [p for p in (getattr(lc, "pid", None) for lc in getattr(engine_set, "launchers", {}).values())
                     if isinstance(p, int) and p > 0]
        controller = getattr(self._cluster, "controller", None)
        if controller is not None and getattr(controller, "pid", -1) > 0:
            pids.append(controller.pid)
            try:
                pids += [c.pid for c in psutil.Process(controller.pid).children(recursive=True)]
            except psutil.Error:
                pass
        write_pids(self.runtime_dir, pids)

    def _start_template(self) -> None:
        """Start the engine template (:mod:`workbench.template`) local engines fork from."""
        if self.launcher.name != "local":
            return
        self._template = subprocess.Popen(
            [sys.executable, "-m", "workbench.template", self.runtime_dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def _wait_for_template(self, progress: ProgressLine, started: float) -> None:
        """Wait until the template can fork engines; if it failed, say why (engines start cold)."""
        path = template.socket_path(self.runtime_dir)
        deadline = time.monotonic() + self.engine_timeout
        while not os.path.exists(path) and self._template.poll() is None and time.monotonic() < deadline:
            progress.show(f"fleet: importing torch ({time.monotonic() - started:.0f} s)…",
                          key=int(time.monotonic() - started))
            time.sleep(0.05)
        if not os.path.exists(path):
            error = self._template.stderr.read().decode(errors="replace").strip().splitlines() \
                if self._template.poll() is not None else ["it did not start in time"]
            print(f"workbench: engines start without the engine template ({error[-1] if error else 'no output'})",
                  file=sys.stderr, flush=True)

    def _start_reaper(self) -> None:
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "workbench.reaper", str(os.getpid()), self.runtime_dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        return [self.member(r).engine_id for r in (ranks if ranks is not None else range(self.world_size))]

    def member(self, rank: int) -> Member:
        return self.members[rank]

    def view(self, engine_id: int):
        """The one-engine view of ``engine_id`` (kept: building one costs ~0.1 ms per cell and rank;
        engine ids are never reused, and a new client starts a new cache)."""
        client, views = self._views
        if client is not self.client:
            views = {}
            self._views = (self.client, views)
        if engine_id not in views:
            views[engine_id] = self.client[engine_id]
        return views[engine_id]

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to the engines of ``ranks``: by pid on this host (no round trip, and it works
        when an engine's nanny is dead), through the nanny for other hosts (bounded wait)."""
        remote = []
        for rank in ranks:
            member = self.member(rank)
            if member.host != socket.gethostname():
                remote.append(rank)
                continue
            try:
                os.kill(member.pid, sig)
            except OSError:
                pass  # gone already: the death is handled by the cell's repair
        if remote:
            future = self.client.send_signal(sig, targets=self.engine_ids(remote), block=False)
            concurrent.futures.wait([future], timeout=CONTROLLER_TIMEOUT_S)

    def dead_ranks(self, settle_s: float = 2.0) -> list[int]:
        """Ranks whose engine is gone (its process ended) or unreachable (the hub unregistered it
        after HUB_SILENT_S without heartbeats), after letting the hub notice a death.
        :meth:`loss` says which."""
        deadline = time.monotonic() + settle_s
        while True:
            alive = set(self.client.ids)
            dead = [m.rank for m in self.members if m.engine_id not in alive]
            gone = self.gone_ranks(list(range(self.world_size)))
            if set(gone) <= set(dead) or time.monotonic() > deadline:
                return sorted(set(dead) | set(gone))
            time.sleep(0.05)

    def gone_ranks(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose engine ran on this host and whose process has ended."""
        here = socket.gethostname()
        return [r for r in ranks if self.member(r).host == here and not _alive(self.member(r).pid)]

    def loss(self, rank: int) -> tuple[str, str]:
        """Why rank ``rank``'s engine is lost: a headline (``rank 1 died (engine 3, pid 123, SIGKILL)``)
        and an explanation. A live process the controller lost contact with (a starved machine)
        is never called dead."""
        m = self.member(rank)
        who = f"engine {m.engine_id}, pid {m.pid}"
        if self._alive_here(m):
            return (f"rank {rank} lost contact ({who}, process alive)",
                    f"the controller lost contact with rank {rank} ({who}): its process is alive but sent "
                    f"no heartbeat for {HUB_SILENT_S} s (the machine may be overloaded)")
        how = self._exit_status(m)
        return (f"rank {rank} died ({who}{', ' + how if how else ''})",
                f"the engine of rank {rank} ({who}) died{f' ({how})' if how else ''}: its process vanished without "
                "a Python error (killed by a signal such as SIGKILL or the OOM killer, or crashed)")

    def _alive_here(self, member: Member) -> bool:
        return member.host == socket.gethostname() and _alive(member.pid)

    def _exit_status(self, member: Member) -> str | None:
        """How a dead engine's process ended, as its launcher saw it (``SIGKILL``, ``exit code 1``)."""
        launcher = self._cluster.engines.get(member.engine_set) if self._cluster is not None else None
        launchers = [launcher, *getattr(launcher, "launchers", {}).values()] if launcher is not None else []

        def exit_code():
            codes = [(getattr(lc, "stop_data", None) or {}).get("exit_code") for lc in launchers]
            codes += [_own_child_exit(getattr(lc, "process", None), member.pid) for lc in launchers]
            if self.runtime_dir:  # an engine forked from the engine template: the template reaped it
                codes.append(template.exit_status(self.runtime_dir, member.pid))
            return next((c for c in codes if isinstance(c, int)), None)

        deadline = time.monotonic() + EXIT_STATUS_WAIT_S  # its launcher's thread notices the exit by itself
        while launchers and exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        code = exit_code()
        if not isinstance(code, int):
            return None
        try:
            return signal.Signals(-code).name if code < 0 else f"exit code {code}"
        except ValueError:
            return f"exit code {code}"

    def replace(self, ranks: list[int]) -> None:
        """Kill the engines of ``ranks`` and start fresh ones in their slots.

        The new engines have empty namespaces; call :meth:`rendezvous` after.
        """
        dead = [self.member(r) for r in ranks]
        for member in dead:
            try:
                self._cluster.signal_engines_sync(signal.SIGKILL, member.engine_set)
            except Exception:
                pass
        gone = {m.engine_id for m in dead}
        self._dead_engines |= gone  # never matched to a slot again, even while the hub still lists them
        deadline = time.monotonic() + 15
        while gone & set(self.client.ids) and time.monotonic() < deadline:
            if set(self.gone_ranks(ranks)) == set(ranks):
                break  # their processes are gone: no need to wait for the hub to notice
            time.sleep(0.05)
        for member in dead:
            self._stop_engine_set(member.engine_set)
        self.members = [m for m in self.members if m.engine_id not in gone]
        self._add_engines([m.slot for m in dead])
        self.fresh_ranks = sorted(set(self.fresh_ranks) | set(ranks))
        if len(self.fresh_ranks) == self.world_size:  # every rank starts over: they agree (all empty)
            self.fresh_ranks = []

    # ------------------------------------------------------------------ process group
    def rendezvous(self) -> None:
        """(Re)build the process group on every rank, on a fresh port.

        An engine found dead before it joined is replaced first (it then counts as a fresh
        rank: %fleet recover gives it the state). One that dies while the others wait for it
        leaves them blocked inside ``init_process_group``, where nothing reaches them: they are
        replaced too, and the group is built once more."""
        if dead := self.dead_ranks(settle_s=0.0):
            print(f"workbench: {'; '.join(self.loss(r)[0] for r in dead)} before joining the process group; "
                  "starting a fresh engine in its place", file=sys.stderr, flush=True)
            self.replace(dead)
        stuck = self._join_all()
        if stuck:
            print(f"workbench: rank {','.join(map(str, stuck))} waited in init_process_group for a rank that "
                  "died; replacing them and building the group again", file=sys.stderr, flush=True)
            self.replace(stuck)
            if stuck := self._join_all():
                raise FleetError(f"the process group could not be built: rank {','.join(map(str, stuck))} died "
                                 "while joining twice; restart the fleet: %fleet stop, then %fleet start")

    def _join_all(self) -> list[int]:
        """Every rank joins a new group; returns the ranks to replace (dead while joining, and the
        ranks left waiting for them), or [] once the group is up."""
        self.generation += 1
        hosts = {m.host for m in self.members}
        rank0 = self.client[self.member(0).engine_id]
        single_host = len(hosts) == 1
        port = rank0.apply_sync(rendezvous.free_port, single_host)
        addr = rendezvous.LOOPBACK if single_host else rank0.apply_sync(rendezvous.host_address)
        store = os.path.join(self.runtime_dir, f"store-{self.generation}") if single_host else None
        pending = []
        started = time.monotonic()
        host_order = list(dict.fromkeys(m.host for m in self.members))  # ranks are grouped by host
        for member in self.members:
            peers = [m for m in self.members if m.host == member.host]
            spec = rendezvous.RendezvousSpec(
                rank=member.rank, world_size=self.world_size,
                local_rank=peers.index(member), local_world_size=len(peers),
                node_rank=host_order.index(member.host), nodes=len(host_order),
                master_addr=addr, master_port=port, backend=self.backend,
                timeout_s=self.pg_timeout, generation=self.generation, store_path=store,
            )
            pending.append((member, self.client[member.engine_id].apply_async(rendezvous.join, spec.to_dict())))
        deadline = time.monotonic() + min(self.pg_timeout, 120) + 10
        waiting, lost = {member.rank: (member, result) for member, result in pending}, set()
        while waiting:
            concurrent.futures.wait([result for _, result in waiting.values()], timeout=execution.PID_CHECK_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for rank, (member, result) in list(waiting.items()):
                if result.ready():
                    del waiting[rank]
                    try:
                        member.device = result.get()["device"]
                    except Exception as exc:
                        if not self.gone_ranks([rank]):
                            raise FleetError(f"rank {rank} could not join the process group: "
                                             f"{_one_line(exc)}") from None
                        lost.add(rank)
            lost |= set(self.gone_ranks(list(waiting)))
            if lost:
                return sorted(lost | set(waiting))
            if time.monotonic() > deadline:
                raise FleetError(f"rank {','.join(map(str, waiting))} did not join the process group "
                                 f"within {deadline - started:.0f} s")
        return []

    # ------------------------------------------------------------------ running code
    def _targets(self, ranks) -> list[int]:
        if not self.running:
            raise FleetError("no fleet is running; start one with %fleet start -n 2 (or Fleet(n=2).start())")
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int):
            ranks = [ranks]
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise OptionsError(f"ranks are whole numbers, e.g. ranks=[0, 1] (got {list(ranks)!r})")
        ranks = sorted(set(ranks))
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks:
            raise OptionsError(
                f"rank {','.join(map(str, bad)) or '(none)'} is out of range: this fleet has ranks "
                f"0-{self.world_size - 1}"
            )
        return ranks

    def _validate(self, options: CellOptions, targets: list[int]) -> None:
        options.validate(self.device_type, self.world_size, len({m.host for m in self.members}), self.backend)
        if (options.custom_parallel or options.comm_hook) and len(targets) != self.world_size:
            raise OptionsError("hsdp, --tp, --pp and --comm-hook need every rank (they build the mesh or DDP "
                               "on the whole group); drop --ranks")

    def execute(
        self,
        code: str,
        options: CellOptions,
        *,
        ranks=None,
        timeout: float | None = None,
        return_value: bool = False,
        show_output: bool = True,
        setup: bool = False,
    ) -> "execution.CellResult":
        """Run ``code`` as a cell on ``ranks``: the engine of ``%%distributed``.

        ``setup``: record the cell (once it ran on every rank without error) to be
        replayed on every rank after :meth:`scale` or a recovery.
        """
        targets = self._targets(ranks)
        self._validate(options, targets)
        if setup and ranks is not None and len(targets) != self.world_size:
            raise OptionsError("a --setup cell runs on every rank (it is replayed on all of them); drop --ranks")
        self._recover_if_dead()
        self._refuse_unrecovered()
        self._cells += 1
        name = f"distributed-cell-{self._cells}"
        args = (code, options.to_dict(), name, return_value, not return_value)
        try:
            result = execution.run_on_ranks(self, targets, engine.run_cell, args, timeout=timeout,
                                            show_output=show_output, title=name)
        except execution.DistributedCellError as exc:
            if not (self.auto_recover and (exc.dead or exc.hung) and self.restarts < self.max_restarts):
                raise
            self.restarts += 1
            what = (f"the engine of rank {','.join(map(str, exc.dead))} died" if exc.dead
                    else f"rank {','.join(map(str, exc.hung))} hung")
            print(f"workbench: auto-recover {self.restarts}/{self.max_restarts}: {what} during the cell; recovering "
                  "(a survivor's state or the latest checkpoint) and running the cell again", file=sys.stderr, flush=True)
            self.recover()
            return self.execute(code, options, ranks=ranks, timeout=timeout, return_value=return_value,
                                show_output=show_output, setup=setup)
        if setup:
            self.setup_cells = [c for c in self.setup_cells if c[0] != code] + [(code, options)]
        elif ranks is None and not self.replaying:
            self.training_cell = (code, options)
        self._adopt_spares()  # spares that registered while the cell ran get warm now
        return result

    def _refuse_unrecovered(self) -> None:
        """A replaced rank has an empty namespace: running cells before %fleet recover would leave
        ranks at different steps and parameters (and end in a collective timeout)."""
        if self.fresh_ranks and not self.replaying:
            raise FleetError(f"rank {','.join(map(str, self.fresh_ranks))} was replaced by a fresh engine (empty "
                             "namespace); run %fleet recover first, so that every rank has the same state")

    def _recover_if_dead(self) -> None:
        """An engine that died between cells: recover (with --auto-recover) or say what to do."""
        dead = self.dead_ranks(settle_s=0.0)
        if not dead:
            return
        if self.auto_recover and self.restarts < self.max_restarts:
            self.restarts += 1
            print(f"workbench: auto-recover {self.restarts}/{self.max_restarts}: the engine of rank "
                  f"{','.join(map(str, dead))} died; recovering (a survivor's state or the latest checkpoint)", file=sys.stderr, flush=True)
            self.recover()
            return
        causes = "; ".join(self.loss(r)[1] for r in dead)
        raise FleetError(f"{causes}. Run %fleet recover (replaces it, replays the --setup cells, gives every "
                         "rank a survivor's state or the latest checkpoint)")

    def scale(self, n: int) -> dict:
        """Resize to ``n`` ranks mid-session: checkpoint, new process group, setup replay,
        resharded restore (see :mod:`workbench.elastic`). Returns each phase's seconds."""
        from .elastic import scale

        return scale(self, n)

    def recover(self, shrink: bool = False) -> dict:
        """After an engine died: replace it (``shrink``: go on without it), rebuild the
        group, replay the setup cells, then restore the survivors' state (a live replica) or the
        latest checkpoint (:mod:`workbench.elastic`)."""
        from .elastic import recover

        result = recover(self, shrink=shrink)
        self.fresh_ranks = []
        return result

    def _launch_cold(self, slots: list[EngineSlot]) -> dict[str, EngineSlot]:
        """Start engines now for the ``slots`` that no warm spare will take, so that they start
        while the caller does other work (a rescale's checkpoint); :meth:`_add_engines` adds them."""
        self._adopt_spares()
        return {self._launch(slot): slot for slot in slots[len(self.spares):]}

    def _add_engines(self, slots: list[EngineSlot], launched: dict[str, EngineSlot] | None = None) -> None:
        """Make ``slots`` ranks: warm spares first, else new engines (``launched``: already started
        by :meth:`_launch_cold`)."""
        launched = dict(launched or {})
        waiting = set(launched.values())
        left = self._take_spares([slot for slot in slots if slot not in waiting])
        sets = {**launched, **{self._launch(slot): slot for slot in left}}
        if sets:
            self._wait_for_engines(sets, ProgressLine(False), time.monotonic())
            self._map_members(sets)

    def _remove_ranks(self, ranks: list[int]) -> None:
        """Stop the engines of ``ranks`` for good (scale down)."""
        doomed = [self.member(r) for r in ranks]
        for member in doomed:
            try:
                self.client.shutdown(targets=[member.engine_id], block=True)
            except Exception:
                pass
            self._stop_engine_set(member.engine_set)
        gone = {m.engine_id for m in doomed}
        self.members = [m for m in self.members if m.engine_id not in gone]
        psutil.wait_procs(_process_trees([m.pid for m in doomed]), timeout=5)
        self._renumber()

    def run(
        self,
        code_or_function: str | Callable,
        *args: Any,
        strategy: str = "ddp",
        mixed_precision: str = "no",
        grad_accum: int = 1,
        ranks=None,
        timeout: float | None = None,
        show_output: bool = True,
        options: CellOptions | None = None,
        **kwargs: Any,
    ) -> list:
        """Run a code string or a function on every rank and return each rank's result.

        A string returns the value of its last expression on each rank; a
        function is called as ``fn(*args, **kwargs)``. Inside, the names of a
        ``%%distributed`` cell (``accelerator``, ``rank``, ...) are defined.
        Tensors come back on CPU. Raises :class:`execution.DistributedCellError`
        if any rank raised. ``options`` (a :class:`CellOptions`, e.g. with ``tp=2``)
        replaces ``strategy``, ``mixed_precision`` and ``grad_accum``.
        """
        options = options or CellOptions(strategy, mixed_precision, grad_accum)
        if callable(code_or_function):
            targets = self._targets(ranks)
            self._validate(options, targets)
            self._refuse_unrecovered()
            call = (code_or_function, args, kwargs, options.to_dict())
            result = execution.run_on_ranks(
                self, targets, engine.run_function, call, timeout=timeout, show_output=show_output,
                title=f"function {getattr(code_or_function, '__qualname__', 'call')}",
            )
        else:
            if args or kwargs:
                raise OptionsError("extra arguments are only accepted when running a function, not a code string")
            result = self.execute(
                code_or_function, options, ranks=ranks, timeout=timeout, return_value=True, show_output=show_output
            )
        return result.values()

    def export(self, path: str, *, overwrite: bool = False) -> list[str]:
        """Write the recorded ``--setup`` cells and the last training cell as a script for
        ``torchrun`` / ``accelerate launch`` (and an sbatch file with ``--launcher slurm``);
        returns the paths written. Warns about cells that need IPython (:mod:`workbench.export`)."""
        from .export import export

        written, warnings = export(
            path, self.setup_cells, self.training_cell, world_size=self.world_size,
            nodes=len({m.host for m in self.members}) or 1, run_id=self.run_id, gpus=self.device_type == "cuda",
            slurm_options=self.launcher.traits if self.launcher.name == "slurm" else None, overwrite=overwrite)
        for warning in warnings:
            print(f"workbench: {warning}", file=sys.stderr)
        return written

    def pull(self, name: str, rank: int = 0) -> Any:
        """Copy the value of ``name`` from one rank's namespace (tensors to CPU)."""
        (target,) = self._targets([rank])
        reply = self.client[self.member(target).engine_id].apply_sync(engine.pull, name)
        if not reply["ok"]:
            raise FleetError(f"rank {target}: {reply['evalue']}; define it in a %%distributed cell first")
        return reply["value"]

    def push(self, **values: Any) -> None:
        """Set ``values`` in every rank's namespace."""
        self._targets(None)
        self.client[self.engine_ids()].apply_sync(engine.push, values)

    # ------------------------------------------------------------------ status
    def status(self) -> list[dict]:
        """One row per rank: rank, engine id, pid, host, device, state, memory."""
        if not self.running:
            return []
        self._adopt_spares()
        alive = set(self.client.ids)
        queues = self._queue_status()
        states = {}
        for m in self.members:
            states[m.rank] = "dead"
            if m.engine_id in alive:
                states[m.rank] = "busy" if queues.get(m.engine_id, {}).get("queue", 0) else "idle"
        idle = [m for m in self.members if states[m.rank] == "idle"]
        asked = {m.rank: self.client[m.engine_id].apply_async(engine.memory_report) for m in idle}
        rows = []
        for m in self.members:
            try:
                memory = asked[m.rank].get(timeout=2) if m.rank in asked else _memory(m)
            except Exception:
                memory = _memory(m)
            rows.append({
                "rank": m.rank, "engine": m.engine_id, "pid": m.pid, "host": m.host,
                "device": m.device, "state": states[m.rank], "memory": memory,
            })
        return rows


    def _queue_status(self, timeout_s: float = CONTROLLER_TIMEOUT_S) -> dict:
        """``client.queue_status()`` with a bound: ipyparallel's waits forever for a controller
        that was killed or is frozen."""
        client = self.client
        future = client._send(client._query_stream, "queue_request", content={"targets": None, "verbose": False})
        if not future.wait(timeout_s):
            raise FleetError(f"the controller did not answer within {timeout_s:g} s (killed or frozen?); "
                             "%fleet stop, then %fleet start")
        content = future.result()["content"]
        if content.pop("status") != "ok":
            return {}
        return {int(k): v for k, v in content.items() if k.isdigit()}

    def spare_status(self) -> dict:
        """Warm spare engines (ready to take a rank) and spares still starting."""
        if self.running:
            self._adopt_spares()
        return {"ready": [{"engine": m.engine_id, "pid": m.pid, "host": m.host} for m in self.spares],
                "starting": len(self._pending_spares)}


ENGINE_MEMORY_BYTES = 500 * 2**20  # an idle CPU engine with torch and accelerate imported (measured ~450 MiB)
CPU_ENGINES_PER_CORE = 4  # past this, gloo collectives and heartbeats starve


def _check_machine_fits(n: int) -> None:
    """Refuse a local CPU fleet this machine cannot hold (memory), warn about one it cannot run well."""
    available = psutil.virtual_memory().available
    cores = os.cpu_count() or 1
    if n * ENGINE_MEMORY_BYTES > available:
        raise OptionsError(f"{n} CPU engines need about {n * ENGINE_MEMORY_BYTES / 2**30:.0f} GiB but this machine has "
                           f"{available / 2**30:.0f} GiB available; use at most -n {max(1, available // ENGINE_MEMORY_BYTES)}")
    if n > CPU_ENGINES_PER_CORE * cores:
        print(f"workbench: {n} CPU engines on {cores} cores will be slow and may time out in collectives; "
              f"consider -n {cores}", file=sys.stderr, flush=True)


def _own_child_exit(process, pid: int) -> int | None:
    """The exit code of the launcher's process ``process`` (a ``psutil.Popen``) if it is the
    engine ``pid`` and has ended: read at once, where the launcher notices the exit only once
    the engine's nanny has closed its output too. psutil keeps the code for the launcher."""
    if process is None or getattr(process, "pid", None) != pid:
        return None
    try:
        return None if process.is_running() else process.wait(0)
    except Exception:  # psutil.TimeoutExpired, or reaped elsewhere
        return None


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _process_trees(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            pass
    return procs


def _memory(member: Member) -> str:
    """Resident memory of a busy local engine, read from outside (remote: unknown)."""
    if member.host != socket.gethostname():
        return "?"
    try:
        rss = psutil.Process(member.pid).memory_info().rss
    except psutil.Error:
        return "-"
    return f"{rss / 2**20:.0f} MiB"


def _one_line(exc: BaseException) -> str:
    text = getattr(exc, "evalue", None) or str(exc)
    name = getattr(exc, "ename", None) or type(exc).__name__
    return f"{name}: {execution.last_line(text, limit=None)}"
