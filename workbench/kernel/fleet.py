"""The fleet: engines joined in one torch.distributed process group, driven from the kernel.

:class:`Fleet` is a façade: it starts and stops the pieces and runs cells, and
coordinates
- the engine pool (:mod:`workbench.kernel.pool`): which engine is which rank, warm spares,
  launching, replacing and removing engines;
- their processes (:mod:`workbench.kernel.processes`): controller, engine template, reaper;
- the process group (:mod:`workbench.kernel.group`), the run's metrics
  (:mod:`workbench.kernel.metrics.live`) and checkpoints (:mod:`workbench.kernel.checkpoints`);
- cells (:mod:`workbench.kernel.cells`, supervised by :mod:`workbench.kernel.execution`), rescale and
  recovery (:mod:`workbench.kernel.elastic`).

Its options are :class:`workbench.options.FleetOptions` (the same as ``%fleet start``'s flags).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from workbench.checkpoint import api as checkpoint_api
from workbench.checkpoint import layout as checkpoint_layout
from workbench.checkpoint import storage as checkpoint_storage
from workbench.errors import FleetError, OptionsError
from workbench.kernel import group, parking
from workbench.kernel.cells import Cells
from workbench.kernel.checkpoints import Checkpoints
from workbench.kernel.devices import EngineSlot, check_machine_fits, parse_gpu_list, plan_engines
from workbench.kernel.elastic import Elastic, check_scale_size
from workbench.kernel.execution import CellResult, DistributedCellError
from workbench.kernel.launchers import LauncherSpec
from workbench.kernel.metrics.live import FleetMetrics
from workbench.kernel.metrics.sinks import check_sink_names
from workbench.kernel.notices import notice
from workbench.kernel.output import ProgressLine
from workbench.kernel.parking import AutoPark, Parked, Usage
from workbench.kernel.pool import EnginePool, Member, is_this_host
from workbench.kernel.processes import Processes, one_line
from workbench.kernel.ranklogs import RankLogs
from workbench.kernel.run_record import RunRecord
from workbench.kernel.runs import new_run_dir
from workbench.kernel.session_state import SessionState
from workbench.metrics.logger import take_config
from workbench.options import CellOptions, FleetOptions, TuneOptions, parse_duration, parse_size
from workbench.placement import Hosts
from workbench.rank import engine, rendezvous

SAVE_WAIT_S = 120.0  # how long stop() waits for a background save to commit
CELL_STOP_WAIT_S = 30.0  # how long stop() from another thread waits for the running cell to stop its ranks


if TYPE_CHECKING:
    from workbench.trials import TuneResult

__all__ = ["Fleet", "FleetOptions", "Member"]


class Fleet:
    """A set of ipyparallel engines joined in one torch.distributed process group.

    Options: the keyword arguments of :class:`~workbench.options.FleetOptions` (or
    ``options=FleetOptions(...)``).

    >>> with Fleet(n=2) as fleet:
    ...     fleet.run("import torch; t = torch.ones(1); torch.distributed.all_reduce(t); t.item()")
    [2.0, 2.0]
    """

    def __init__(self, n: int | None = None, *, options: FleetOptions | None = None, **kwargs: Any) -> None:
        self.options = options = FleetOptions.build(n, options, kwargs)
        check_sink_names(options.sinks or [])
        gpus = parse_gpu_list(options.gpus) if isinstance(options.gpus, str) else options.gpus
        self.launcher = LauncherSpec(options.launcher, options.batch_options(), options.launcher_config,
                                     options.ranks_per_node)
        self.attached = options.attached  # an ipcluster that is not ours
        self.record: RunRecord | None = None  # <run>/run.json
        self.parked: Parked | None = None  # %fleet park: no engines until the next command
        self.usage = Usage()  # device time and idle share (%fleet status)
        self.command_lock = threading.RLock()  # one command at a time (auto-park runs in a thread)
        self.last_command_at = time.monotonic()
        self.autopark: AutoPark | None = None
        self._command_depth = 0
        self.cell_thread: int | None = None  # the thread running a cell on the ranks now
        self.stop_requested = threading.Event()  # stop() from another thread: that cell stops its ranks
        hosts = options.placement()
        if not self.launcher.local or self.attached:
            places = hosts.assign(options.n, []) if hosts else [None] * (options.n or 0)
            slots = [EngineSlot(i, host=host) for i, host in enumerate(places)]
            self.device_type = "cuda" if options.backend == "nccl" else "cpu"
        else:
            slots = plan_engines(options.n, gpus, cpu=options.cpu)
            self.device_type = slots[0].device_type
            if self.device_type == "cpu":
                check_machine_fits(len(slots))
        self.memory_limit = parse_size(options.memory_limit)
        self.backend = options.backend or ("nccl" if self.device_type == "cuda" else "gloo")
        self.processes = Processes(self.launcher, float(options.engine_timeout), self.attached)
        self.pool = EnginePool(self.processes, slots, self.device_type, float(options.engine_timeout),
                               self._join_run, hosts)
        self.run_id: str | None = None
        self.run_dir: str | None = None
        self.metrics: FleetMetrics | None = None
        self.rank_logs: RankLogs | None = None  # <run>/logs: each rank's output, each engine's own
        self.checkpoints = Checkpoints(self)
        self.session = SessionState()  # setup and training cells, cell defaults, restarts, fresh ranks
        self.cells = Cells(self)  # a cell's checks, its run on the ranks, its record
        self.elastic = Elastic(self, self.cells)  # rescale and recovery
        self.generation = 0  # of the process group: one more at every rendezvous
        self.group_mark = 0  # the metrics records of the current process group start here
        self.slow_reported: set[int] = set()  # stragglers already named in a cell's output

    # ------------------------------------------------------------------ the pool's view
    @property
    def running(self) -> bool:
        """Started and not stopped (a parked fleet runs: its engines come back at the next command)."""
        return self.pool.client is not None and (bool(self.pool.members) or self.parked is not None)

    @contextlib.contextmanager
    def command(self, busy: bool = False):
        """One command on the fleet at a time; its time counts as busy (a cell) or not, and it
        ends an idle stretch (:mod:`workbench.kernel.parking`)."""
        with self.command_lock:
            self._command_depth += 1
            self.usage.count(self.world_size)
            started = time.monotonic()
            try:
                yield
            finally:
                self._command_depth -= 1
                if busy and self._command_depth == 0:
                    self.usage.busy_seconds += time.monotonic() - started
                self.usage.count(self.world_size)
                self.last_command_at = time.monotonic()
                if self.autopark is not None:
                    self.autopark.active()

    @contextlib.contextmanager
    def cell_running(self):
        """While this thread runs a cell on the ranks (:meth:`stop` from another thread stops it)."""
        previous, self.cell_thread = self.cell_thread, threading.get_ident()
        try:
            yield
        finally:
            self.cell_thread = previous

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def nodes(self) -> int:
        """Hosts the ranks run on (the ranks see it as ``RendezvousSpec.nodes``)."""
        return len({m.host for m in self.members}) or 1

    @property
    def members(self) -> list[Member]:
        """The ranks, in rank order."""
        return self.pool.members

    @property
    def cell_defaults(self) -> CellOptions:
        """What a cell's flags fall back to (ddp, no, 1 unless :meth:`tune` applied others)."""
        return self.session.cell_defaults

    @cell_defaults.setter
    def cell_defaults(self, options: CellOptions) -> None:
        self.session.cell_defaults = options

    @property
    def client(self):
        """The ipyparallel client that reaches the engines."""
        return self.pool.client

    @property
    def runtime_dir(self) -> str | None:
        return self.processes.runtime_dir

    @property
    def checkpoint_dir(self) -> str | None:
        """Where this run's checkpoints go: ``--checkpoint-dir`` (a folder or an fsspec URL), else
        ``<run>/checkpoints``; None before the first start."""
        if self.options.checkpoint_dir is not None:
            return checkpoint_storage.absolute(self.options.checkpoint_dir)
        return checkpoint_layout.checkpoints_dir(self.run_dir) if self.run_dir is not None else None

    def member(self, rank: int) -> Member:
        return self.pool.member(rank)

    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        return self.pool.engine_ids(ranks)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "Fleet":
        """Start the controller and engines, then join them in a process group."""
        if self.running:
            raise FleetError("this fleet is already running; use it, or stop it first with %fleet stop")
        self.stop_requested.clear()
        if self.options.checkpoint_dir is not None:
            checkpoint_storage.store_for(self.options.checkpoint_dir).prepare(self.options.checkpoint_dir)
        if self.launcher.node_jobs and self.pool.hosts is None and not self.attached:
            self.launcher.ranks_per_node()  # asks sinfo now: a cluster it cannot size fails before anything starts
        started = time.monotonic()
        progress = ProgressLine(self.options.progress)
        try:
            self.processes.make_runtime_dir()
            self.run_id, self.run_dir = new_run_dir(self.options.runs_dir)
            self.rank_logs = self.processes.rank_logs = RankLogs(self.run_dir)
            options = {k: v for k, v in asdict(self.options).items() if v is not None and k != "progress"}
            self.record = RunRecord.begin(self.run_id, self.run_dir, self.options.name, options)
            self.record.add_config(take_config())  # workbench.config(...) in the kernel before the start
            self.metrics = FleetMetrics(
                self.run_id, self.run_dir, self.runtime_dir, lambda: self.world_size,
                {"name": self.record.name, "ranks": len(self.pool.slots), "backend": self.backend,
                 "device_type": self.device_type, "fleet": options, **self.record.config},
                wandb=self.options.wandb, tensorboard=self.options.tensorboard, sinks=self.options.sinks or [],
                network=self.launcher.remote or self.attached,  # engines on other hosts send over TCP
            )
            if self.attached:
                progress.show("fleet: connecting to the running cluster…")
                self.processes.connect(self.options.profile, self.options.cluster_id)
                self.pool.attach(len(self.pool.slots))
            else:
                progress.show(f"fleet: starting controller ({self.launcher.name} engines)…")
                self.processes.start_controller(progress, started)
                self.pool.start(progress, started)
            self.pool.launch_spares(self.options.spares)
            progress.show(f"fleet: {self.world_size} engines up; joining process group ({self.backend})…")
            self.rendezvous()
            self.session.every_rank_has_state()  # an engine replaced while starting: no rank has state yet
            self.usage = Usage()
            if self.options.park_after is not None:
                self.autopark = AutoPark(self, parse_duration(self.options.park_after), self.options.park_anyway)
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
        """Stop every engine and the controller; nothing is left running (an attached
        ipcluster keeps its engines: they only leave the process group)."""
        if self.autopark is not None:
            self.autopark.close()
            self.autopark = None
        if self.cell_thread not in (None, threading.get_ident()):
            self.stop_requested.set()  # the cell's thread stops its ranks (SIGINT, then kill), then we go on
            deadline = time.monotonic() + CELL_STOP_WAIT_S
            while self.cell_thread is not None and time.monotonic() < deadline:
                time.sleep(0.05)
        locked = self.command_lock.acquire(timeout=CELL_STOP_WAIT_S)  # an auto-park under way ends first
        try:
            self._stop_processes()
        finally:
            if locked:
                self.command_lock.release()

    def _stop_processes(self) -> None:
        client = self.pool.client
        pids = self.pool.local_pids()
        if client is not None and self.pool.members:
            self._finish_saves(client)
        if self.attached and client is not None:
            try:
                client[self.engine_ids()].apply_async(rendezvous.leave).get()
            except Exception:
                pass
            try:
                client.close()
            except Exception:
                pass
        self.pool.close()
        self.parked = None
        if self.record is not None and self.record.status == "running":
            self.record_config({})  # what the kernel gave workbench.config since the last cell
            self.record.end()
        if self.metrics is not None:
            self.metrics.close()  # the records stay readable in fleet.metrics.store
        self.processes.stop(client, pids)

    def _finish_saves(self, client, timeout_s: float = SAVE_WAIT_S) -> None:
        """Background saves still writing commit before the engines stop (bounded); one that
        cannot is named as lost."""
        try:
            pending = client[self.engine_ids()].apply_async(checkpoint_api.has_pending).get(timeout=10)
        except Exception:  # an engine that cannot answer has no save to wait for
            return
        tags = sorted({tag for tag in pending if tag})
        if not tags:
            return
        notice(f"waiting for the background save of checkpoint {', '.join(map(repr, tags))} before stopping…")
        try:
            results = client[self.engine_ids()].apply_async(checkpoint_api.finish_pending, timeout_s).get(
                timeout=timeout_s + 10)
        except Exception as exc:
            results = [{"tag": tags[0], "error": f"a rank could not finish it ({type(exc).__name__})"}]
        for result in results:
            if result.get("error"):
                notice(f"checkpoint {result['tag']!r} is lost: {result['error']}")
                break

    def __enter__(self) -> "Fleet":
        return self.start() if not self.running else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{self.world_size} ranks, {self.backend}" if self.running else "stopped"
        return f"<workbench.Fleet {state}>"

    def _join_run(self, engine_ids: list[int]) -> None:
        """New engines join the run: metrics to the collector (this host's engines through its Unix
        socket, other hosts' over TCP), checkpoints under the run, memory limit."""
        collector = self.metrics.collector
        by_address: dict[str, list[int]] = {}
        for engine_id in engine_ids:
            host = self.pool.host_of(engine_id)
            by_address.setdefault(collector.address_for(host, is_this_host(host)), []).append(engine_id)
        for address, ids in by_address.items():
            self.pool.client[ids].apply_async(engine.attach, address, collector.key, self.run_dir,
                                              self.checkpoint_dir, self.memory_limit,
                                              self.device_type == "cpu").get()

    def adopt_spares(self) -> None:
        """Spare engines that registered since become warm (torch and accelerate imported)."""
        if adopted := self.pool.adopt_spares():
            self.pool.client[adopted].apply_async(engine.warm)

    def spare_status(self) -> dict:
        """Warm spare engines (ready to take a rank) and spares still starting."""
        if self.running:
            self.adopt_spares()
        return self.pool.spare_status()

    # ------------------------------------------------------------------ engines and the process group
    def replace(self, ranks: list[int]) -> None:
        """Kill the engines of ``ranks`` and start fresh ones in their slots.

        The new engines have empty namespaces (fresh ranks, until %fleet recover gives them the
        state); call :meth:`rendezvous` after.
        """
        self.pool.replace(ranks)
        self.session.replaced(ranks, self.world_size)

    def rendezvous(self) -> None:
        """(Re)build the process group on every rank, on a fresh port.

        An engine found dead before it joined is replaced first (it then counts as a fresh
        rank: %fleet recover gives it the state). One that dies while the others wait for it
        leaves them blocked inside ``init_process_group``, where nothing reaches them: they are
        replaced too, and the group is built once more."""
        if dead := self.pool.dead_ranks(settle_s=0.0):
            notice(f"{'; '.join(self.pool.loss(r)[0] for r in dead)} before joining the process group; "
                   "starting a fresh engine in its place")
            self.replace(dead)
        stuck = self._join_all()
        if stuck:
            notice(f"rank {','.join(map(str, stuck))} waited in init_process_group for a rank that "
                   "died; replacing them and building the group again")
            self.replace(stuck)
            if stuck := self._join_all():
                raise FleetError(f"the process group could not be built: rank {','.join(map(str, stuck))} died "
                                 "while joining twice; restart the fleet: %fleet stop, then %fleet start")
        self.group_mark, self.slow_reported = len(self.metrics.store), set()

    def _join_all(self) -> list[int]:
        self.generation += 1
        return group.join_all(self.pool, backend=self.backend, timeout_s=float(self.options.pg_timeout),
                              generation=self.generation, runtime_dir=self.runtime_dir,
                              master_addr=self.options.master_addr)

    # ------------------------------------------------------------------ running code
    def targets(self, ranks) -> list[int]:
        """``ranks`` (None: all) checked against this fleet: a sorted list, or a one-line error."""
        return self.cells.targets(ranks)

    def execute(self, code: str, options: CellOptions, *, ranks=None, timeout: float | None = None,
                return_value: bool = False, show_output: bool = True, setup: bool = False,
                show_all_progress: bool = False, stop_on_nan: bool = False) -> CellResult:
        """Run ``code`` as a cell on ``ranks``: the engine of ``%%distributed`` (:mod:`workbench.kernel.cells`).

        ``setup``: record the cell (once it ran on every rank without error) to be
        replayed on every rank after :meth:`scale` or a recovery. ``show_all_progress``:
        show every rank's progress bars, not only the first rank's. ``stop_on_nan``: the
        cell fails at the first NaN or infinite value a rank logs.

        Around the cell: an engine that died since the last command is recovered first
        (``--auto-recover``; else a one-line error); a rank lost during the cell is recovered
        and the cell runs again (``--auto-recover``); a rank that turned slow is named (and
        replaced with ``--auto-replace-stragglers``).
        """
        run = functools.partial(self.cells.execute, code, options, ranks=ranks, timeout=timeout,
                                return_value=return_value, show_output=show_output, setup=setup,
                                show_all_progress=show_all_progress, stop_on_nan=stop_on_nan)
        with self.command(busy=True):
            self.cells.admit(options, ranks, setup)  # bad flags or ranks: one line before anything changes
            self.session.refuse_if_unfinished()  # before a dead engine's message: engines are half set up
            self._recover_lost_ranks()
            while True:
                try:
                    result = run()
                except DistributedCellError as exc:
                    how = self.elastic.auto_recovery(f"{exc.what_was_lost()} during the cell", again=True) \
                        if exc.dead or exc.hung else None
                    if how is None:
                        raise
                    self.recover(**how)
                    continue
                if (slow := self._name_stragglers()) and self.options.auto_replace_stragglers:
                    if how := self.elastic.auto_recovery(f"rank {','.join(map(str, slow))} is slow", replace=slow):
                        self.recover(**how)
                return result

    def _name_stragglers(self) -> list[int]:
        """After a cell: name each newly slow rank once; returns the slow ranks."""
        from workbench.kernel.metrics.stragglers import describe

        slow = self.stragglers()
        for rank in sorted(set(slow) - self.slow_reported):
            notice(f"{describe(rank, slow[rank])}; %fleet replace {rank} swaps it for a fresh engine "
                   "(keeping the training state)")
        self.slow_reported |= set(slow)
        return sorted(slow)

    def _recover_lost_ranks(self) -> None:
        """Engines that died since the last command: recovered now with ``--auto-recover``, else
        a one-line error that says what to do."""
        if (how := self.elastic.lost_between_cells()) is not None:
            self.recover(**how)

    def stragglers(self) -> dict[int, float]:
        """Slow ranks of the current process group: ``{rank: compute ratio}``
        (the rule: :mod:`workbench.kernel.metrics.stragglers`)."""
        from workbench.kernel.metrics.stragglers import slow_ranks
        from workbench.kernel.metrics.summary import per_rank

        if self.metrics is None:
            return {}
        ranks = per_rank(self.metrics.store.since(self.group_mark))
        return {r: ratio for r, ratio in slow_ranks(ranks).items() if r < self.world_size}

    def scale(self, n: int, hosts: str | None = None) -> dict:
        """Resize to ``n`` ranks mid-session: checkpoint, new process group, setup replay,
        resharded restore (see :mod:`workbench.kernel.elastic`). Returns each phase's seconds.
        ``hosts`` (``"hostC:2"``, ``--launcher ssh``): more hosts for the new engines."""
        check_scale_size(n)
        with self.command():
            if hosts is not None:
                if self.pool.hosts is None and not self.pool.cluster_hosts:
                    raise OptionsError("scale --hosts adds hosts to a fleet started with --hosts (--launcher ssh or "
                                       "slurm), or attached to an ipcluster on other hosts")
                if self.pool.hosts is None:  # attached: these hosts take the new engines
                    self.pool.hosts = Hosts.parse(hosts)
                else:
                    self.pool.hosts.add(Hosts.parse(hosts))
            self.targets(None)
            self.session.refuse_if_unfinished()
            self._recover_lost_ranks()
            return self.elastic.scale(n)

    def recover(self, shrink: bool = False, replace: list[int] = ()) -> dict:
        """After an engine died: replace it (``shrink``: go on without it), rebuild the
        group, replay the setup cells, then restore the survivors' state (a live replica) or the
        latest checkpoint (:mod:`workbench.kernel.elastic`). ``replace``: live ranks to swap for fresh
        engines the same way (a straggler: ``%fleet replace R``)."""
        with self.command():
            return self.elastic.recover(shrink=shrink, replace=self.targets(list(replace)) if replace else [])

    def park(self, anyway: bool = True) -> "Parked":
        """Checkpoint what a rescale keeps, stop every engine (their GPUs are free), remember the
        size; the next command (or :meth:`unpark`) brings it back (:mod:`workbench.kernel.parking`).
        ``anyway=False``: refuse when rank 0 holds names that no setup cell makes."""
        with self.command():
            return parking.park(self, anyway=anyway)

    def unpark(self) -> dict:
        """Start the parked fleet's engines again, replay the setup cells and restore."""
        with self.command():
            return parking.unpark(self)

    def run(
        self,
        code_or_function: str | Callable,
        *args: Any,
        strategy: str | None = None,
        mixed_precision: str | None = None,
        grad_accum: int | None = None,
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
        Tensors come back on CPU. Raises :class:`~workbench.kernel.execution.DistributedCellError`
        if any rank raised. ``options`` (a :class:`CellOptions`, e.g. with ``tp=2``)
        replaces ``strategy``, ``mixed_precision`` and ``grad_accum``; what neither gives
        comes from :attr:`cell_defaults` (ddp, no, 1 unless :meth:`tune` applied others).
        """
        given = {"strategy": strategy, "mixed_precision": mixed_precision, "grad_accum": grad_accum}
        options = options or replace(self.cell_defaults, **{k: v for k, v in given.items() if v is not None})
        if callable(code_or_function):
            with self.command(busy=True):
                result = self.cells.call(code_or_function, args, kwargs, options, ranks=ranks, timeout=timeout,
                                         show_output=show_output)
        elif args or kwargs:
            raise OptionsError("extra arguments are only accepted when running a function, not a code string")
        else:
            result = self.execute(
                code_or_function, options, ranks=ranks, timeout=timeout, return_value=True, show_output=show_output
            )
        return result.values()

    def tune(self, step: Callable | str, model: Any, batch: Callable | str, optimizer: Callable | str | None = None,
             *, options: TuneOptions | None = None, **option_values: Any) -> "TuneResult":
        """Short trials of a training step on every rank over micro-batch sizes, gradient
        accumulation, strategies and precisions (:func:`workbench.trials.tune`: the arguments,
        names of functions on the ranks or functions); returns the table. Unless ``apply=False``,
        the fastest configuration that fit becomes :attr:`cell_defaults` and ``micro_batch_size``
        is set on every rank. The model's trained state is never changed."""
        from workbench.kernel.tuner import tune_fleet

        options = replace(options, **option_values) if options is not None else TuneOptions(**option_values)
        return tune_fleet(self, step, model, batch, optimizer, options)

    def export(self, path: str, *, overwrite: bool = False) -> list[str]:
        """Write the recorded ``--setup`` cells and the last training cell as a script for
        ``torchrun`` / ``accelerate launch`` (and an sbatch file with ``--launcher slurm``);
        returns the paths written. Warns about cells that need IPython (:mod:`workbench.kernel.export`)."""
        from workbench.kernel.export import export

        written, warnings = export(
            path, self.session.setup_cells, self.session.training_cell, world_size=self.world_size,
            nodes=self.nodes, run_id=self.run_id, gpus=self.device_type == "cuda",
            slurm_options=self.launcher.traits if self.launcher.name == "slurm" else None, overwrite=overwrite)
        for warning in warnings:
            notice(warning)
        return written

    def pull(self, name: str, rank: int = 0) -> Any:
        """Copy the value of ``name`` from one rank's namespace (tensors to CPU)."""
        with self.command():
            (target,) = self.targets([rank])
        try:
            reply = self.client[self.member(target).engine_id].apply_async(engine.pull, name).get()
        except Exception as exc:  # the value cannot travel back (not picklable: a lock, an open file, ...)
            raise FleetError(f"rank {target}: {name!r} cannot be copied to the kernel: {one_line(exc)}") from None
        if not reply["ok"]:
            raise FleetError(f"rank {target}: {reply['evalue']}; define it in a %%distributed cell first")
        return reply["value"]

    def push(self, **values: Any) -> None:
        """Set ``values`` in every rank's namespace."""
        with self.command():
            self.targets(None)
        try:
            self.client[self.engine_ids()].apply_async(engine.push, values).get()
        except Exception as exc:  # a value that cannot travel (not picklable: a lock, a generator, ...)
            raise FleetError(f"cannot send {', '.join(map(repr, values))} to the ranks: {one_line(exc)}") from None

    def record_config(self, values: dict) -> None:
        """Add ``values`` (and what the kernel gave ``workbench.config``) to the run's record and wandb's config."""
        values = {**values, **take_config()}
        if values and self.record is not None:
            self.record.add_config(values)
            if self.metrics is not None:
                self.metrics.update_config(values)

    def stacks(self, native: bool = False, everything: bool = False) -> str:
        """Where every rank's threads are now (Python frames; ``native``: C frames too, through
        py-spy), identical stacks grouped across ranks; the ranks are not stopped. ``everything``:
        also the engine's own frames and threads."""
        from workbench.rank.stacks import collect

        if not self.running:
            raise FleetError("no fleet is running; start one with %fleet start -n 2")
        return collect(self.pool.members, self.run_dir, self.world_size, native=native, everything=everything)

    def status(self) -> list[dict]:
        """One row per rank: rank, engine id, pid, host, device, state, memory (:mod:`workbench.kernel.status`)."""
        from workbench.kernel.status import status_rows

        if not self.running:
            return []
        self.adopt_spares()
        return status_rows(self.pool, self.stragglers())
