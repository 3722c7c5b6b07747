"""The engine pool: which ipyparallel engine is which rank, the warm spares, and launching,
replacing and removing engines. Kernel side; :class:`workbench.Fleet` coordinates it.

Each rank is its own ipyparallel engine set, so that every engine gets its own
environment (``CUDA_VISIBLE_DEVICES`` with exactly one GPU) and can be stopped or
replaced alone. Local engines fork from the engine template (:mod:`workbench.rank.template`).
The processes behind the pool (controller, template, reaper) are :mod:`workbench.kernel.processes`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from workbench.errors import FleetError, OptionsError
from workbench.kernel.devices import EngineSlot, visible_gpus
from workbench.kernel.notices import notice
from workbench.kernel.output import ProgressLine
from workbench.kernel.processes import CONTROLLER_TIMEOUT_S, HUB_SILENT_S, Processes, alive, exit_status, process_trees
from workbench.messages import Identity
from workbench.placement import Hosts
from workbench.rank import rendezvous

EXIT_GRACE_S = 5.0  # an engine whose launcher says it exited gets this long to show up registered
QUIET_S = 1.5  # a rank on another host that sent nothing this long (heartbeats go every second) is quiet
PROBE_TIMEOUT_S = 1.0  # a host whose ranks are all quiet is asked whether it answers (sshd, slurmd)
PROBE_EVERY_S = 2.0  # at most this often per host
REMOTE_SIGNAL_WAIT_S = 0.2  # a signal to another host's engine is sent through its nanny


@dataclass
class Member:
    """One rank of the fleet (or a spare, rank -1) and the engine that runs it."""

    rank: int
    slot: EngineSlot
    engine_id: int
    pid: int
    host: str
    engine_set: str
    device: str = "cpu"

    @property
    def local(self) -> bool:
        """Its engine runs on this host: its pid means something here (signals, liveness, the reaper)."""
        return is_this_host(self.host)


def is_this_host(host: str | None) -> bool:
    return host in (None, "", "localhost", "127.0.0.1", socket.gethostname())


class EnginePool:
    """The fleet's engines: ``members`` (rank order), ``spares`` (warm, outside the group) and
    the client that reaches them. ``on_new_engines(engine_ids)`` is called for every engine
    that becomes a rank or a spare (the fleet attaches it to the run)."""

    def __init__(self, processes: Processes, slots: list[EngineSlot], device_type: str,
                 engine_timeout: float, on_new_engines: Callable[[list[int]], None], hosts: Hosts | None = None) -> None:
        self.processes = processes
        self.slots = slots
        self.hosts = hosts  # --hosts: where engines may start, and how many on each
        self.device_type = device_type
        self.engine_timeout = engine_timeout
        self.on_new_engines = on_new_engines
        self.members: list[Member] = []
        self.spares: list[Member] = []
        self.pending_spares: dict[str, EngineSlot] = {}  # engine set -> slot, not registered yet
        # extra environment of the engine of a slot: e.g. WORKBENCH_HOSTNAME to simulate nodes in tests
        self.slot_environment: dict[int, dict[str, str]] = {}
        self.client = None
        self._identities: dict[int, Identity] = {}  # engine id -> rendezvous.identify()
        self._dead_engines: set[int] = set()  # replaced engines (the hub may list a dead one for a while)
        self._views: tuple = (None, {})  # (client, {engine id: its view}): see view()
        self._set_counter = 0
        self.lost_hosts: dict[str, str] = {}  # host -> why it was given up (``host hostB lost (ranks 1,2): …``)
        self._probed: dict[str, float] = {}  # host -> when it was last asked whether it answers
        self._stale: dict[str, list[int]] = {}  # lost host -> pids of the engines left there (fenced when back)
        self.cluster_hosts: list[str] = []  # attached to an ipcluster on other hosts: the hosts of its engines

    @property
    def world_size(self) -> int:
        return len(self.members)

    def member(self, rank: int) -> Member:
        return self.members[rank]

    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        return [self.member(r).engine_id for r in (ranks if ranks is not None else range(self.world_size))]

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

    def record_pids(self) -> None:
        self.processes.record_pids(self.local_pids())

    def local_pids(self, members: list[Member] | None = None) -> list[int]:
        """The pids of the engines (of ``members``, default all) on this machine: another host's pid
        numbers mean nothing here. A launcher that starts engines here only (local, mpi) has them all
        here, also those that pose as other nodes (``WORKBENCH_HOSTNAME`` in tests)."""
        here = not self.processes.launcher.remote
        return [m.pid for m in (self.members + self.spares if members is None else members) if here or m.local]

    # ------------------------------------------------------------------ starting engines
    def start(self, progress: ProgressLine, started: float) -> None:
        """Launch an engine for every slot and make them the ranks (slot order)."""
        sets = self.launch_all(self.slots)
        self.client = self.processes.cluster.connect_client_sync()
        self.wait_for(sets, progress, started)
        self.map_members(sets)

    def launch_all(self, slots: list[EngineSlot]) -> dict[str, list[EngineSlot]]:
        """Start engines for ``slots``: one engine set per slot, or per host where the launcher
        starts a node's engines as one job (Slurm). Returns engine set id -> its slots."""
        if not self.processes.launcher.node_jobs:
            return {self.launch([slot]): [slot] for slot in slots}
        by_host: dict[str | None, list[EngineSlot]] = {}
        for slot in slots:
            by_host.setdefault(slot.host, []).append(slot)
        jobs = [group for host, group in by_host.items() if host is not None]
        anywhere = by_host.get(None, [])  # Slurm picks the nodes: --ranks-per-node of them a job
        size = self.processes.launcher.ranks_per_node() if anywhere else 1
        jobs += [anywhere[i:i + size] for i in range(0, len(anywhere), size)]
        return {self.launch(group): group for group in jobs}

    def launch(self, slots: list[EngineSlot]) -> str:
        """Start the engines of ``slots`` as one engine set; returns its id (they register later)."""
        first = slots[0]
        env = {
            **self.processes.launcher.environment(),
            "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self._engines_on(first.host)))
            ),
            "PYTHONUNBUFFERED": "1",
        }
        if len(slots) == 1:
            env["WORKBENCH_SLOT"] = str(first.slot)
            if first.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = first.gpu
            env.update(self.slot_environment.get(first.slot, {}))
        else:  # one job's tasks: each engine takes its task's slot (rendezvous.identify)
            env["WORKBENCH_SLOTS"] = ",".join(str(slot.slot) for slot in slots)
        self._set_counter += 1
        set_id = f"slot{first.slot}-{self._set_counter}"
        try:
            self.processes.cluster.start_engines_sync(
                n=len(slots), engine_set_id=set_id, environment=env,
                **self.processes.launcher.engine_set_kwargs(slots, avoid=list(self.lost_hosts)))
        except BaseException:  # an interrupt half-way: no engine nobody knows of may come up later
            try:
                self.processes.stop_engine_set(set_id)
            except Exception:  # it never got as far as an engine set
                pass
            raise
        self.record_pids()  # before it registers: a kill of the kernel now must not orphan it
        return set_id

    def host_of(self, engine_id: int) -> str:
        """The host an engine said it runs on when it registered."""
        return self._identities[engine_id]["host"]

    def replaceable(self, ranks: list[int]) -> None:
        """Raise a one-line OptionsError, before anything changes, when a rank of ``ranks`` is on a
        lost host and no other host has a free slot for it."""
        self.readmit_hosts()
        on_lost = [r for r in ranks if self.on_lost_host(r)]
        if not on_lost:
            return
        free = self._free_hosts(len(on_lost), [self.member(r) for r in ranks])
        if free is None:
            hosts = ", ".join(sorted({self.member(r).host for r in on_lost}))
            raise OptionsError(f"rank {','.join(map(str, on_lost))} ran on {hosts}, which is lost, and no other host has "
                               f"a free slot: %fleet recover --shrink goes on without them (then %fleet scale N "
                               "--hosts HOST:K adds a host)")

    def readmit_hosts(self) -> list[str]:
        """Lost hosts that answer again (the partition healed, the machine rebooted): the engines
        left there (those of its ranks too, which stay dead ranks until recovered) are stopped
        first (fenced: a stale engine never trains with the fleet again), then its slots take new
        engines."""
        port = self.processes.launcher.probe_port
        back = []
        for host in list(self.lost_hosts) if port is not None else []:
            try:
                with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                    pass
            except OSError:
                continue
            left = [m for m in self.members if m.host == host]
            self._dead_engines |= {m.engine_id for m in left}
            stale = self._stale.pop(host, []) + [m.pid for m in left]
            self.processes.launcher.fence(host, stale)
            del self.lost_hosts[host]
            back.append(host)
            notice(f"host {host} answers again: its stale engines were stopped (pid "
                   f"{','.join(map(str, stale)) or 'none'}); its slots take new engines")
        return back

    def _free_hosts(self, count: int, leaving: list[Member]) -> list[str | None] | None:
        """Hosts with free slots for ``count`` engines, lost hosts and the slots of ``leaving`` aside."""
        if self.hosts is None and self.cluster_hosts:
            return self._least_loaded(count, leaving)
        if self.hosts is None:  # Slurm picks a node that is not lost; other launchers cannot move a rank
            return [None] * count if self.processes.launcher.node_jobs else None
        try:
            return self.hosts.assign(count, self._used_hosts(leaving))
        except OptionsError:
            return None

    def _least_loaded(self, count: int, leaving: list[Member]) -> list[str] | None:
        """Attached to an ipcluster on other hosts: hosts of its engines for ``count`` more, the one
        with the fewest engines first (lost hosts aside); None if every host is lost."""
        load = Counter(self._used_hosts(leaving))
        alive = [h for h in self.cluster_hosts if h not in self.lost_hosts]
        if not alive:
            return None
        places = []
        for _ in range(count):
            host = min(alive, key=lambda h: (load[h], alive.index(h)))
            load[host] += 1
            places.append(host)
        return places

    def _used_hosts(self, leaving: list[Member] = ()) -> list[str]:
        """A host's name once per slot taken: by a rank or spare (not ``leaving``), a spare starting,
        and every slot of a lost host."""
        gone = {m.engine_id for m in leaving}
        used = [m.slot.host for m in self.members + self.spares if m.engine_id not in gone]
        used += [s.host for s in self.pending_spares.values()]
        if self.hosts is None:
            return used
        return used + [h for h, n in self.hosts.slots.items() if h in self.lost_hosts for _ in range(n)]

    def _placed_again(self, slot: EngineSlot, leaving: list[Member]) -> EngineSlot:
        """``slot`` for a fresh engine: on a host with a free slot when its own host is lost."""
        if slot.host not in self.lost_hosts:
            return slot
        hosts = self._free_hosts(1, leaving)
        if hosts is None:
            raise OptionsError(f"host {slot.host} is lost and no other host has a free slot for rank {slot.slot}")
        return EngineSlot(slot.slot, slot.gpu, hosts[0])

    def _engines_on(self, host: str | None) -> int:
        """How many engines share ``host``'s cores (its --hosts slots, else the fleet's engines there)."""
        if self.hosts is not None and host in self.hosts.slots:
            return self.hosts.slots[host]
        return max(1, sum(s.host == host for s in self.slots))

    def _identify_new(self) -> None:
        """Ask engines that registered since the last call who they are (slot, pid, host)."""
        new = [e for e in self.client.ids if e not in self._identities and e not in self._dead_engines]
        asked = {e: self.client[e].apply_async(rendezvous.identify) for e in new}
        for engine_id, reply in asked.items():
            try:
                self._identities[engine_id] = reply.get()
            except Exception:  # it died on its way up: its slot's launcher says so (wait_for)
                self._dead_engines.add(engine_id)

    def _unassigned(self) -> dict[int, tuple[int, Identity]]:
        """Registered engines that are neither a rank nor a spare, by launch slot."""
        taken = {m.engine_id for m in self.members + self.spares} | self._dead_engines
        registered = set(self.client.ids)
        return {info["slot"]: (e, info) for e, info in self._identities.items()
                if e in registered and e not in taken}

    def wait_for(self, sets: dict[str, list[EngineSlot]], progress: ProgressLine, started: float) -> None:
        """Wait until the engines of ``sets`` have all registered (all or nothing: the caller stops
        them all on an error); one-line errors if one exits or time runs out."""
        deadline = time.monotonic() + self.engine_timeout
        exited: dict[str, float] = {}  # engine set -> when its launcher first said it exited
        total = sum(len(slots) for slots in sets.values())
        while True:
            self._identify_new()
            up = set(self._unassigned())
            missing = {set_id: [s for s in slots if s.slot not in up] for set_id, slots in sets.items()}
            missing = {set_id: slots for set_id, slots in missing.items() if slots}
            if not missing:
                return
            for set_id, slots in missing.items():
                launcher = self.processes.cluster.engines.get(set_id)
                if launcher is not None and launcher.stop_data:
                    # the launcher can report an exit while the engine's registration is still reaching
                    # this client (seen on a loaded machine: "Completed registration" as its last line)
                    exited.setdefault(set_id, time.monotonic())
                    if time.monotonic() - exited[set_id] < EXIT_GRACE_S:
                        continue
                    log = self.processes.engine_log(set_id).strip().splitlines()
                    last = log[-1] if log else "no output"
                    raise FleetError(f"the engine for rank slot {_slot_names(slots)} exited while starting: {last}")
            count = total - sum(len(slots) for slots in missing.values())
            if time.monotonic() > deadline:
                waiting = [self._not_started(set_id, slots) for set_id, slots in missing.items()]
                raise FleetError(
                    f"only {count} of {total} engines registered within {self.engine_timeout:.0f} s"
                    + (f" ({'; '.join(waiting)}); none are kept" if any(waiting) else
                       "; the machine may be overloaded: try again, or pass a larger engine_timeout")
                )
            progress.show(f"fleet: starting engines {count}/{total} ({time.monotonic() - started:.0f} s)…",
                          key=count)
            time.sleep(0.1)

    def _not_started(self, set_id: str, slots: list[EngineSlot]) -> str:
        """Why the engines of ``slots`` are not up, where the launcher can say (a pending batch job)."""
        reason = self.processes.launcher.pending_reason(self.processes.cluster.engines.get(set_id))
        if reason is None:
            return ""
        where = f" for {slots[0].host}" if slots[0].host is not None else ""
        return f"{reason}{where}"

    def map_members(self, sets: dict[str, list[EngineSlot]]) -> None:
        """Match new engines to their slots and give every engine its rank (slot order)."""
        unassigned = self._unassigned()
        new_ids = []
        for set_id, slots in sets.items():
            for slot in slots:
                if slot.slot not in unassigned:  # it registered, then died before it got its rank
                    raise FleetError(f"the engine for rank slot {slot.slot} exited right after starting; try again")
                engine_id, info = unassigned[slot.slot]
                self.members.append(Member(-1, slot, engine_id, info["pid"], info["host"], set_id))
                new_ids.append(engine_id)
        self._renumber()
        self.on_new_engines(new_ids)

    def _renumber(self) -> None:
        """Ranks in slot order, grouped by host (a host's ranks are consecutive, as torchrun numbers them)."""
        first_slot: dict[str, int] = {}
        for member in self.members:
            first_slot[member.host] = min(first_slot.get(member.host, member.slot.slot), member.slot.slot)
        self.members.sort(key=lambda m: (first_slot[m.host], m.slot.slot))
        for rank, member in enumerate(self.members):
            member.rank = rank
        self.record_pids()

    def attach(self, wanted: int) -> None:
        """Make the engines of the running ipcluster the ranks (``wanted``: how many; 0: all)."""
        cluster = self.processes.cluster
        self.client = cluster.connect_client_sync()
        # without -n: every engine the cluster was started with (a daemonized ipcluster returns
        # before they all register), else those registered by the deadline
        started = sum(getattr(s, "n", 0) or 0 for s in cluster.engines.values()) or cluster.n or 1
        wanted = wanted or started
        deadline = time.monotonic() + self.engine_timeout
        while len(self.client.ids) < wanted:
            if time.monotonic() > deadline:
                if self.slots or not self.client.ids:
                    raise FleetError(f"the cluster has {len(self.client.ids)} engines registered, fewer than asked")
                print(f"fleet: {len(self.client.ids)} of the cluster's {started} engines registered in "
                      f"{self.engine_timeout:g} s; using those", file=sys.stderr)
                break
            time.sleep(0.1)
        self._identify_new()
        if self.processes.launcher.remote:  # new engines go to these hosts, not all to the first
            self.cluster_hosts = list(dict.fromkeys(info["host"] for info in self._identities.values()))
        ids = sorted(self._identities)[: len(self.slots) or None]
        for i, engine_id in enumerate(ids):
            info = self._identities[engine_id]
            host = info["host"] if self.cluster_hosts else None
            self.members.append(Member(-1, EngineSlot(i, host=host), engine_id, info["pid"], info["host"], ""))
        self._renumber()
        self.on_new_engines(ids)

    # ------------------------------------------------------------------ spares
    def new_slots(self, count: int) -> list[EngineSlot]:
        """Slots for ``count`` more engines: the next slot numbers, and GPUs not in use
        (by a rank, a spare, or a spare still starting)."""
        used = [m.slot for m in self.members + self.spares] + list(self.pending_spares.values())
        first = max(s.slot for s in used) + 1 if used else 0
        if self.hosts is not None:  # ranks and spares count against their host's slots; lost hosts are full
            self.readmit_hosts()
            places = self.hosts.assign(count, self._used_hosts())
            return [EngineSlot(first + i, host=host) for i, host in enumerate(places)]
        if self.cluster_hosts:  # attached: the cluster's hosts, the one with the fewest engines first
            places = self._least_loaded(count, [])
            if places is None:
                raise OptionsError("every host of the cluster is lost: %fleet scale N --hosts HOST:K adds one")
            return [EngineSlot(first + i, host=host) for i, host in enumerate(places)]
        if self.device_type == "cpu" or not self.processes.launcher.local:  # a scheduler gives the GPUs
            return [EngineSlot(first + i) for i in range(count)]
        busy = {s.gpu for s in used}
        free = [g for g in visible_gpus() if g not in busy]
        if len(free) < count:
            raise OptionsError(
                f"scaling needs {count} more GPUs but only {len(free)} visible GPU(s) are free "
                f"({', '.join(free) or 'none'}); one engine per GPU"
            )
        return [EngineSlot(first + i, free[i]) for i in range(count)]

    def launch_spares(self, count: int) -> None:
        """Start ``count`` spare engines in the background (as many as free GPUs allow)."""
        if count <= 0:
            return
        try:
            slots = self.new_slots(count)
        except OptionsError as exc:
            notice(f"no spare engine started: {exc}")
            return
        for slot in slots:
            self.pending_spares[self.launch([slot])] = slot
        self.record_pids()

    def adopt_spares(self) -> list[int]:
        """Take spare engines that have registered since; drop spares that died. Returns the
        engine ids adopted (the caller warms them)."""
        if not self.pending_spares and not self.spares:
            return []
        self._identify_new()
        registered = set(self.client.ids)
        self.spares = [m for m in self.spares if m.engine_id in registered]
        unassigned = self._unassigned()
        adopted = []
        for set_id, slot in list(self.pending_spares.items()):
            if slot.slot in unassigned:
                engine_id, info = unassigned[slot.slot]
                self.spares.append(Member(-1, slot, engine_id, info["pid"], info["host"], set_id))
                adopted.append(engine_id)
                del self.pending_spares[set_id]
        if adopted:
            self.record_pids()
            self.on_new_engines(adopted)
        return adopted

    def _take_spares(self, slots: list[EngineSlot]) -> list[EngineSlot]:
        """Give ``slots`` to warm spares where there are some; return the slots left over."""
        self.adopt_spares()
        taken = 0
        while slots and self.spares:
            spare, slot = self.spares.pop(0), slots[0]
            slots = slots[1:]
            spare.slot = EngineSlot(slot.slot, spare.slot.gpu, spare.slot.host)  # the rank's place; the spare's GPU, host
            self.members.append(spare)
            taken += 1
        if taken:
            self._renumber()
            self.launch_spares(taken)
        return slots

    def spare_status(self) -> dict:
        """Warm spare engines (ready to take a rank) and spares still starting."""
        return {"ready": [{"engine": m.engine_id, "pid": m.pid, "host": m.host} for m in self.spares],
                "starting": len(self.pending_spares)}

    # ------------------------------------------------------------------ changing the ranks
    def launch_cold(self, slots: list[EngineSlot]) -> dict[str, list[EngineSlot]]:
        """Start engines now for the ``slots`` that no warm spare will take, so that they start
        while the caller does other work (a rescale's checkpoint); :meth:`add_engines` adds them."""
        self.adopt_spares()
        return self.launch_all(slots[len(self.spares):])

    def add_engines(self, slots: list[EngineSlot], launched: dict[str, list[EngineSlot]] | None = None) -> None:
        """Make ``slots`` ranks: warm spares first, else new engines (``launched``: already started
        by :meth:`launch_cold`)."""
        launched = dict(launched or {})
        waiting = {slot for group in launched.values() for slot in group}
        left = self._take_spares([slot for slot in slots if slot not in waiting])
        sets = {**launched, **self.launch_all(left)}
        if sets:
            self.wait_for(sets, ProgressLine(False), time.monotonic())
            self.map_members(sets)

    def remove_ranks(self, ranks: list[int]) -> None:
        """Stop the engines of ``ranks`` for good (scale down)."""
        doomed = [self.member(r) for r in ranks]
        for member in doomed:
            if member.host in self.lost_hosts:  # nothing there answers: asking would only wait
                continue
            try:
                self.client.shutdown(targets=[member.engine_id], block=True)
            except Exception:
                pass
        gone = {m.engine_id for m in doomed}
        self._dead_engines |= gone  # never a rank again (a lost host's engine may come back to the hub)
        self.members = [m for m in self.members if m.engine_id not in gone]
        self._end_engine_sets(doomed)
        psutil.wait_procs(process_trees(self.local_pids(doomed)), timeout=5)
        self._renumber()

    def _end_engine_sets(self, departed: list[Member]) -> None:
        """Stop the engine sets of ``departed`` (already out of the members) that no rank or spare
        still runs in: a node's Slurm job ends with its last engine. A lost host's sets are only
        forgotten (nothing there answers), except a batch job, which its scheduler cancels; the pids
        of the engines left on a lost host are kept, to stop them if it answers again."""
        in_use = {m.engine_set for m in self.members + self.spares}
        for member in departed:
            if member.host in self.lost_hosts:
                self._stale.setdefault(member.host, []).append(member.pid)
        for set_id, host in {m.engine_set: m.host for m in departed}.items():
            if set_id in in_use:
                continue
            if host in self.lost_hosts and not self.processes.launcher.node_jobs:
                self.processes.forget_engine_set(set_id, host)
            else:
                self.processes.stop_engine_set(set_id)

    def replace(self, ranks: list[int]) -> None:
        """Kill the engines of ``ranks`` and start fresh ones (empty namespaces) in their slots."""
        dead = [self.member(r) for r in ranks]
        gone = {m.engine_id for m in dead}
        fenced = {m.rank for m in dead if m.engine_id in self._dead_engines}  # stopped on a host that came back
        shared = {m.engine_set for m in self.members + self.spares if m.engine_id not in gone and m.engine_set}
        alone = [m for m in dead if m.host not in self.lost_hosts and m.engine_set not in shared]
        together = [m for m in dead if m.host not in self.lost_hosts and m.engine_set in shared]
        for member in alone:
            if not member.engine_set:  # an attached cluster's own engine: the fleet has no launcher of it
                continue
            try:
                self.processes.cluster.signal_engines_sync(signal.SIGKILL, member.engine_set)
            except Exception:
                pass
        if together:  # the others of its job live on: this engine alone, through its nanny
            self.signal([m.rank for m in together], signal.SIGKILL)
        self._dead_engines |= gone  # never matched to a slot again, even while the hub still lists them
        deadline = time.monotonic() + 15
        while gone & set(self.client.ids) and time.monotonic() < deadline:
            if set(self.gone_ranks(ranks)) | {r for r in ranks if self.on_lost_host(r)} | fenced == set(ranks):
                break  # their processes are gone (or their host is): no need to wait for the hub to notice
            time.sleep(0.05)
        self.members = [m for m in self.members if m.engine_id not in gone]
        self._end_engine_sets(dead)
        self.add_engines([self._placed_again(m.slot, dead) for m in dead])

    # ------------------------------------------------------------------ signals and health
    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to the engines of ``ranks``: by pid on this host (no round trip, and it works
        when an engine's nanny is dead), through the nanny for other hosts (bounded wait)."""
        remote = []
        for rank in ranks:
            member = self.member(rank)
            if not member.local:
                remote.append(rank)
                continue
            try:
                os.kill(member.pid, sig)
            except OSError:
                pass  # gone already: the death is handled by the cell's repair
        registered = set(self.client.ids)
        targets = [e for e in self.engine_ids(remote) if e in registered]  # an engine gone has no nanny left
        if targets:  # not waited for long: a dead host's nanny never confirms, and the cell's loop must go on
            future = self.client.send_signal(sig, targets=targets, block=False)
            concurrent.futures.wait([future], timeout=REMOTE_SIGNAL_WAIT_S)

    def dead_ranks(self, settle_s: float = 2.0) -> list[int]:
        """Ranks whose engine is gone (its process ended) or unreachable (the hub unregistered it
        after HUB_SILENT_S without heartbeats), after letting the hub notice a death.
        :meth:`loss` says which."""
        deadline = time.monotonic() + settle_s
        while True:
            registered = set(self.client.ids)
            dead = [m.rank for m in self.members
                    if m.engine_id not in registered or m.host in self.lost_hosts or m.engine_id in self._dead_engines]
            gone = self.gone_ranks(list(range(self.world_size)))
            if set(gone) <= set(dead) or time.monotonic() > deadline:
                return sorted(set(dead) | set(gone))
            time.sleep(0.05)

    def lost_hosts_now(self, store, now: float) -> dict[str, str]:
        """Other hosts just found lost: none of their ranks sent anything for QUIET_S (the metrics
        heartbeat goes every second) and the host itself refuses connections (its processes are
        gone) or does not answer on the network (a partition, or a machine that is down). A rank
        waiting in a collective was seen to send nothing for many seconds too, so silence alone
        decides nothing: a host that answers is alive. Each such host is given up for good:
        returns host -> headline (``host hostB lost (ranks 1,2): …``)."""
        port = self.processes.launcher.probe_port
        if port is None:
            return {}
        by_host: dict[str, list[Member]] = {}
        for m in self.members:
            if not m.local and m.host not in self.lost_hosts:
                by_host.setdefault(m.host, []).append(m)
        found = {}
        for host, members in by_host.items():
            streams = [store.streams.get(m.rank) for m in members]
            heard = [s.beat_at for s, m in zip(streams, members, strict=True) if s is not None and s.pid == m.pid]
            if len(heard) < len(members) or now - max(heard) < QUIET_S:
                continue  # a rank not heard from yet, or one heard lately
            if now - self._probed.get(host, 0.0) < PROBE_EVERY_S:
                continue
            self._probed[host] = now
            ranks = ",".join(str(m.rank) for m in members)
            try:
                with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                    continue  # the host answers: its ranks are busy, not lost
            except ConnectionRefusedError:
                how = (f"lost (ranks {ranks}): its ranks went silent and the host refuses connections (its "
                       "processes are gone)")
            except OSError:
                how = (f"unreachable (ranks {ranks}): its ranks went silent and the host does not answer on the "
                       "network (a partition, or the machine is down)")
            self.lost_hosts[host] = found[host] = f"host {host} {how}"
        return found

    def quiet(self, rank: int, store, now: float) -> bool:
        """Rank ``rank`` runs on another host and has sent nothing for QUIET_S: its host may be lost
        (:meth:`lost_hosts_now` decides), so it is not killed and replaced there meanwhile."""
        m = self.member(rank)
        stream = store.streams.get(rank)
        return not m.local and stream is not None and stream.pid == m.pid and now - stream.beat_at > QUIET_S

    def on_lost_host(self, rank: int) -> bool:
        return self.member(rank).host in self.lost_hosts

    def gone_ranks(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose engine ran on this host and whose process has ended."""
        return [r for r in ranks if self.member(r).local and not alive(self.member(r).pid)]

    def loss(self, rank: int) -> tuple[str, str]:
        """Why rank ``rank``'s engine is lost: a headline that says which rank of how many
        (``rank 1 of 2 died (engine 3, pid 123, SIGKILL)``; a lost host's names its ranks) and an
        explanation. A live process the controller lost contact with (a starved machine)
        is never called dead."""
        m = self.member(rank)
        who = f"engine {m.engine_id}, pid {m.pid}"
        if m.host in self.lost_hosts:
            return self.lost_hosts[m.host], self.lost_hosts[m.host]
        if m.local and alive(m.pid):
            return (f"rank {rank} of {self.world_size} lost contact ({who}, process alive)",
                    f"the controller lost contact with rank {rank} ({who}): its process is alive but sent "
                    f"no heartbeat for {HUB_SILENT_S} s (the machine may be overloaded)")
        how = exit_status(self.processes, m.engine_set, m.pid)
        if how and how.startswith("exit code ") and how != "exit code 0":  # os._exit(n), or a crash's own code
            code = how.removeprefix("exit code ")
            return (f"rank {rank} of {self.world_size} exited with code {code} ({who})",
                    f"the engine of rank {rank} ({who}) exited with code {code} without a Python error "
                    "(os._exit, or a library that ended the process); a fresh engine takes its place")
        return (f"rank {rank} of {self.world_size} died ({who}{', ' + how if how else ''})",
                f"the engine of rank {rank} ({who}) died{f' ({how})' if how else ''}: its process vanished without "
                "a Python error (killed by a signal such as SIGKILL or the OOM killer, or crashed)")

    def queue_status(self, timeout_s: float = CONTROLLER_TIMEOUT_S) -> dict:
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

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Forget every engine (the caller stops their processes)."""
        self.client, self.members, self.spares = None, [], []
        self.pending_spares, self._identities, self._dead_engines = {}, {}, set()


def _slot_names(slots: list[EngineSlot]) -> str:
    return ",".join(str(slot.slot) for slot in slots)
