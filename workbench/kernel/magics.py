"""IPython magics: a thin parsing layer over :class:`workbench.Fleet`.

``%fleet start|status|stop|pull|push`` and ``%%distributed``. Bad input and
fleet problems become one-line ``UsageError`` messages; a failing cell raises
:class:`~workbench.kernel.execution.DistributedCellError`, which IPython renders as
each distinct rank traceback once.
"""

from __future__ import annotations

import atexit
import functools
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from workbench.errors import WorkbenchError
from workbench.kernel.execution import DistributedCellError
from workbench.kernel.flags import checkpoint_parser, distributed_parser, fleet_parser, metrics_parser, options_from
from workbench.kernel.fleet import Fleet
from workbench.kernel.ranklogs import logs_dir
from workbench.kernel.status import status_table
from workbench.options import CellCall, CellOptions, FleetOptions, TuneOptions


class FleetSession:
    """The fleet this kernel's ``%fleet start`` started, and the metrics of the last one
    (still readable after ``%fleet stop``). The lab panel reads it (handed over at
    ``%load_ext``), so the panel never imports the magics."""

    def __init__(self) -> None:
        self.fleet: Fleet | None = None
        self.last_metrics = None

    def current_fleet(self) -> Fleet | None:
        """The running fleet, if any."""
        return self.fleet if self.fleet is not None and self.fleet.running else None

    def current_metrics(self):
        """The metrics of the running fleet, or of the last one this kernel stopped."""
        fleet = self.current_fleet()
        return fleet.metrics if fleet is not None else self.last_metrics

    def stop(self) -> None:
        if self.fleet is not None:
            self.last_metrics = self.fleet.metrics or self.last_metrics
            self.fleet.stop()
            self.fleet = None


def _session() -> FleetSession | None:
    """The session of the magics loaded in this IPython shell (None without ``%load_ext workbench``)."""
    from IPython import get_ipython

    shell = get_ipython()
    magics = shell.magics_manager.registry.get("WorkbenchMagics") if shell is not None else None
    return magics.session if magics is not None else None


def current_fleet() -> Fleet | None:
    """The fleet that ``%fleet start`` started in this kernel, if it is running."""
    session = _session()
    return session.current_fleet() if session is not None else None


def current_metrics():
    """The metrics of the running fleet, or of the last one this kernel stopped."""
    session = _session()
    return session.current_metrics() if session is not None else None


def _friendly(method):
    """Turn workbench's one-line errors into UsageError (no traceback)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except DistributedCellError:
            raise
        except WorkbenchError as exc:
            raise UsageError(str(exc)) from None

    return wrapper


class _RankValue:
    """The last expression's value on rank 0, displayed like a normal cell's."""

    def __init__(self, bundle: dict) -> None:
        self.bundle = bundle

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.bundle

    def __repr__(self) -> str:
        return self.bundle.get("text/plain", "")


@magics_class
class WorkbenchMagics(Magics):
    """``%fleet``, ``%%distributed``, ``%checkpoint`` and ``%metrics``; :attr:`session` holds the fleet."""

    def __init__(self, shell=None) -> None:
        super().__init__(shell)
        self.session = FleetSession()

    @line_magic
    @_friendly
    def fleet(self, line: str):
        """Manage the engine fleet: one ipyparallel engine per rank (per GPU).

        %fleet start [-n N] [flags: see below]
            Start N engines (default: one per visible GPU, or 2 CPU engines) and
            join them in a torch.distributed process group (gloo on CPU, nccl on GPU).
            The run's files go to ./workbench-runs/<run-id>/ (metrics.jsonl, wandb/, tensorboard/, logs/).
            --auto-recover: when an engine dies during a cell, replace it, replay the
            --setup cells, restore a survivor's state or the latest checkpoint, run the
            cell again (at most --max-restarts times). --hang-timeout: no heartbeat
            counts only after 3 s (three beats). --memory-limit: going over it is that
            rank's error. --launcher options pass through to ipyparallel's launcher by
            name; --profile / --cluster-id use the engines of a running ipcluster.
        %fleet status
            Table of rank, engine id, pid, host, device, state and memory; with
            several hosts, grouped by host (node).
        %fleet stacks [--native] [--all]
            Where every rank's threads are now (Python frames; --native: C frames too,
            through py-spy), identical stacks grouped across ranks; nothing is stopped.
            --all: also the engine's own frames and threads.
        %fleet scale N [--hosts HOST:N,...]
            Resize to N ranks, keeping training state: checkpoint, new process
            group, replay of the %%distributed --setup cells on every rank,
            resharded restore. Re-run the training cell to go on from workbench.step.
            New engines go to the first host with a free slot; --hosts adds hosts.
            Attached to an ipcluster on several hosts: to its host with the fewest.
        %fleet recover [--shrink]
            After an engine died: replace it (--shrink: go on without it), rebuild
            the process group, replay the --setup cells, then give every rank the
            survivors' state (DDP: a live replica) or the latest complete
            checkpoint (resharded).
        %fleet replace R[,R]
            Swap live ranks (a straggler that %fleet status shows as slow) for
            fresh engines (a warm spare first), the same way: new group, setup
            replay, the survivors' state or the latest checkpoint. A rank is slow
            when its compute per step (step time minus time in collectives) is
            over 1.3x the other ranks' median over the last 20 steps;
            --auto-replace-stragglers replaces it after the cell that showed it.
        %fleet tune STEP --model M --batch B [--optimizer O] [flags: see below]
            Short trials of a training step, step(model, batch) -> loss, defined on
            the ranks: every strategy x precision x micro-batch size (gradient
            accumulation keeps --global-batch), a table of samples/s and peak
            memory; running out of memory is a result. The fastest configuration
            that fits becomes the next cells' default flags and micro_batch_size
            on every rank. The model's trained state is never changed.
        %fleet pull NAME [--rank R]
            Copy NAME from a rank's namespace into the kernel (tensors to CPU):
            binds NAME in the kernel's namespace and returns the value.
        %fleet push NAME=EXPR [NAME=EXPR ...]
            Evaluate each EXPR in the kernel and set NAME on every rank.
        %fleet export PATH.py [--force]
            Write the recorded --setup cells and the last training cell as one script
            that runs unchanged under torchrun --nproc-per-node N and accelerate launch
            (with --launcher slurm, also PATH.sbatch with the fleet's Slurm options).
        %fleet park [--if-nothing-lost]
            Checkpoint what a rescale keeps, stop every engine (their GPUs are free) and
            remember the size; the next cell (or %fleet unpark) starts the engines, replays
            the --setup cells and restores. Names on rank 0 that no setup cell makes are
            listed (they are lost). %fleet start --park-after 30m parks by itself.
        %fleet unpark
            Bring a parked fleet back now.
        %fleet stop
            Stop every engine and the controller.
        """
        args = fleet_parser().parse_line(line)
        if args is None:  # -h: help printed
            return None
        if args.command is None:
            raise UsageError("%fleet needs a command: start, status, stacks, park, unpark, scale, recover, replace, tune, pull, push, export or stop "
                             "(see %fleet?)")
        if args.command == "start":
            return self._start(args)
        fleet = self.session.current_fleet()
        if args.command == "stop":
            if fleet is None:
                print("no fleet is running")
            self.session.stop()
            return None
        if fleet is None:
            raise UsageError("no fleet is running; start one with %fleet start -n 2")
        commands = {
            "status": lambda: self._status(fleet),
            "park": lambda: fleet.park(anyway=args.anyway),
            "unpark": lambda: fleet.unpark(),
            "stacks": lambda: print(fleet.stacks(native=args.native, everything=args.everything)),
            "scale": lambda: fleet.scale(args.n, hosts=args.hosts),
            "recover": lambda: fleet.recover(shrink=args.shrink),
            "replace": lambda: fleet.recover(replace=args.ranks),
            "tune": lambda: fleet.tune(args.step, args.model, args.batch, args.optimizer,
                                       options=options_from(args, TuneOptions)),
            "pull": lambda: self._pull(fleet, args.name, args.rank),
            "push": lambda: fleet.push(**self._evaluate(args.assignments)),
            "export": lambda: self._export(fleet, args.path, args.force),
        }
        result = commands[args.command]()
        return result if args.command in ("tune", "pull") else None

    def _start(self, args) -> None:
        if (running := self.session.current_fleet()) is not None:
            raise UsageError(f"a fleet is already running ({running.world_size} ranks); "
                             "use it, or stop it first with %fleet stop")
        from workbench.kernel.launchers import parse_options

        args.launcher_options = parse_options(args.launcher_options)
        fleet = Fleet(options=options_from(args, FleetOptions))
        self.session.fleet = fleet.start()
        print(f"fleet: run {fleet.run_id} in {fleet.run_dir}")

    @staticmethod
    def _status(fleet: Fleet) -> None:
        if fleet.parked is not None:
            parked = fleet.parked
            print(f"parked since {time.strftime('%H:%M:%S', time.localtime(parked.since))}: {parked.world} ranks, "
                  f"state in checkpoint {parked.tag!r}; the next cell or %fleet unpark brings it back")
        else:
            print(status_table(fleet.status()))
        print(fleet.usage.line(fleet.world_size, fleet.device_type))
        tuned = {k: v for k, v in fleet.cell_defaults.to_dict().items() if v != getattr(CellOptions(), k)}
        if tuned:
            print("cell defaults (from %fleet tune): " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                  for k, v in tuned.items()))
        spares = fleet.spare_status()
        if spares["ready"] or spares["starting"]:
            print(f"spares: {len(spares['ready'])} warm"
                  + (f" (engine {', '.join(str(s['engine']) for s in spares['ready'])})" if spares["ready"] else "")
                  + (f", {spares['starting']} starting" if spares["starting"] else ""))

    def _pull(self, fleet: Fleet, name: str, rank: int):
        """Bind ``name`` in the kernel's namespace to its value on ``rank``; returns it."""
        value = self.shell.user_ns[name] = fleet.pull(name, rank=rank)
        return value

    @staticmethod
    def _export(fleet: Fleet, path: str, force: bool) -> None:
        for written in fleet.export(path, overwrite=force):
            print(f"wrote {written}")
        print(f"run it with: torchrun --nproc-per-node {fleet.world_size} {path}")

    def _evaluate(self, assignments: list[str]) -> dict:
        values = {}
        for item in assignments:
            name, sep, expr = item.partition("=")
            if not sep or not name.isidentifier():
                raise UsageError(f"%fleet push takes NAME=EXPR pairs, e.g. %fleet push lr=3e-4 (got {item!r})")
            try:
                values[name] = eval(expr, self.shell.user_ns)
            except Exception as exc:
                raise UsageError(f"%fleet push: could not evaluate {expr!r}: {type(exc).__name__}: {exc}") from None
        return values

    @cell_magic
    @_friendly
    def distributed(self, line: str, cell: str):
        """Run the cell on every rank of the fleet.

        %%distributed [flags: see below]

        Each rank keeps its own namespace across cells. Defined in every cell:
        accelerator (an accelerate.Accelerator built from the flags; FSDP is
        FSDP2, also on CPU), rank, world_size, local_rank, device, workbench.
        Output streams live per rank; an exception on any rank stops all ranks,
        shows each distinct traceback once, and leaves the fleet usable.
        The last expression's value on the first rank is shown as the result.
        --setup records the cell (model, optimizer, data): %fleet scale replays
        the recorded setup cells on every rank before restoring the state.
        A flag not given takes the fleet's default: the one below, or what
        %fleet tune chose (%fleet status shows it).

        Parallelism (applied by accelerator.prepare; see workbench.parallel):
        --comm-hook compresses DDP's all-reduce with torch's hooks; --strategy
        hsdp shards inside groups and replicates across them (--mesh RxS,
        default: shard inside a node); --tp N splits layers over N ranks (a
        model's tp_plan, or nn.Linear pairs of an nn.Sequential; FSDP over the
        rest with --strategy fsdp); --pp N cuts an nn.Sequential into N stages,
        trained with model.train_step(x, target=y, loss_fn=f);
        --activation-checkpointing recomputes each block in backward. The
        DeviceMesh is the name `mesh` in the cell. fsdp and hsdp shard each block
        as its own unit, then the root (--fsdp-wrap auto: a Hugging Face model's
        _no_split_modules, else the items of its nn.ModuleList, else the children
        of an nn.Sequential); --fsdp-wrap none makes the model one unit.
        --strategy none wraps nothing, but the rank is still the distributed
        environment of accelerate launch (your own Accelerator() gathers).
        """
        fleet = self.session.current_fleet()
        args = distributed_parser().parse_line(line, fleet.cell_defaults.to_dict() if fleet is not None else None)
        if args is None:  # -h: help printed
            return None
        if fleet is None:
            raise UsageError("no fleet is running; start one with %fleet start -n 2")
        call = options_from(args, CellCall)
        result = fleet.execute(cell, options_from(args, CellOptions), ranks=call.ranks, timeout=call.timeout,
                               setup=call.setup, show_all_progress=call.show_all_progress,
                               stop_on_nan=call.stop_on_nan)
        bundle = result.display(result.ranks[0])
        return _RankValue(bundle) if bundle else None


    @line_magic
    @_friendly
    def checkpoint(self, line: str):
        """Sharded checkpoints of every rank's prepared objects (torch.distributed.checkpoint).

        %checkpoint save [--tag NAME] [--async] [--keep-last K] [--to DIR|URL]
            Save models, optimizers, schedulers, dataloader positions, RNG states,
            workbench.step and registered objects; each rank writes its own shard.
            The tag defaults to step-<workbench.step>. --async returns once the
            state is copied and writes in the background; --keep-last K then
            deletes all but the newest K complete checkpoints; --to saves into
            another folder or an fsspec URL (s3://bucket/prefix).
        %checkpoint list [DIR|URL]
            Table: tag, step, world size, strategy, size, time, state.
        %checkpoint restore [TAG|latest|PATH|URL]
            Load into the prepared objects with the same names on every rank,
            also into a different world size (resharding). Default: latest. A
            folder or URL of checkpoints restores its newest.
        %checkpoint rm TAG
            Delete a checkpoint.
        %checkpoint wait
            Wait until background saves have finished.
        %checkpoint export TAG --hf DIR [--model NAME]
            Write the checkpoint's model as a Hugging Face folder (config.json from the
            fleet's model, safetensors shards, as save_pretrained writes them), assembled
            on the CPU in a process of its own; from_pretrained(DIR) loads it.

        Checkpoints live in ./workbench-runs/<run-id>/checkpoints/<tag>/, or under
        %fleet start --checkpoint-dir DIR|URL. A save is atomic: written to a temporary
        folder, committed by a manifest and a rename; on object storage (S3...) written
        in place and committed by its manifest, written last.
        """
        args = checkpoint_parser().parse_line(line)
        if args is None:  # -h: help printed
            return None
        if args.command is None:
            raise UsageError("%checkpoint needs a command: save, list, restore, rm, wait or export (see %checkpoint?)")
        fleet = self.session.current_fleet()
        if fleet is None:
            raise UsageError("no fleet is running; start one with %fleet start -n 2 and run your setup cells first")
        checkpoints = fleet.checkpoints
        if args.command == "save":
            tag = checkpoints.save(args.tag, async_=args.async_, keep_last=args.keep_last, to=args.to)
            how = "is being written in the background" if args.async_ else "saved"
            print(f"checkpoint {tag!r} {how} ({args.to or checkpoints.folder})")
        elif args.command == "list":
            print(checkpoints.table(args.folder))
        elif args.command == "restore":
            print(_restored_line(checkpoints.restore(args.tag)))
        elif args.command == "rm":
            checkpoints.remove(args.tag)
            print(f"checkpoint {args.tag!r} removed")
        elif args.command == "wait":
            checkpoints.wait()
            print("no checkpoint is being written")
        elif args.command == "export":
            started = time.monotonic()
            files = checkpoints.export(args.tag, args.hf, model=args.model)
            print(f"exported to {args.hf} in {time.monotonic() - started:.1f} s: {', '.join(files)}")

    @line_magic
    @_friendly
    def metrics(self, line: str):
        """Show the live metrics dashboard of the current fleet run.

        %metrics              the dashboard widget (per-rank progress, scalar curves,
                              step time, throughput, communication time, memory)
        %metrics --summary    a text summary of the whole run: last/min/mean per rank
        %metrics --path       where the run's metrics.jsonl, wandb run, TensorBoard files and logs are

        Inside %%distributed cells, ranks log with workbench.log(loss=...); the
        dashboard also appears by itself under a cell that logs.
        """
        args = metrics_parser().parse_line(line)
        if args is None:  # -h: help printed
            return None
        metrics = self.session.current_metrics()
        if metrics is None:
            raise UsageError("no fleet has run in this kernel; start one with %fleet start -n 2")
        if args.path:
            where = {"wandb": "off (pip install 'torch-workbench[wandb]' to have it)",
                     "tensorboard": "off (pip install tensorboard to have it)", **metrics.locations()}
            if where["wandb"] is None:
                where["wandb"] = "no wandb run yet (nothing logged)"
            for kind, location in where.items():
                print(f"{kind + ':':12} {location or 'nothing written yet'}")
            print(f"{'logs:':12} {logs_dir(metrics.run_dir)}  (each rank's output)")
        elif args.summary:
            print(metrics.summary())
        else:
            from workbench.kernel.output import in_kernel

            if not in_kernel():
                print(metrics.summary())
            else:
                metrics.display_dashboard()


def _restored_line(report: dict) -> str:
    world = report["world_size"]
    resharded = f", resharded from {report['saved_world_size']} ranks" if report["saved_world_size"] != world else ""
    what = ", ".join(report["restored"]) or "nothing (no prepared objects with these names)"
    return (f"restored checkpoint {report['tag']!r} (step {report['step']}) on {world} ranks{resharded}: {what}; "
            "workbench.step is now " + str(report["step"]))


def _add_generated_help() -> None:
    """Each magic's docstring (``%fleet?``) ends with its flags, generated from its parser."""
    for magic, parser in ((WorkbenchMagics.fleet, fleet_parser), (WorkbenchMagics.distributed, distributed_parser),
                          (WorkbenchMagics.checkpoint, checkpoint_parser), (WorkbenchMagics.metrics, metrics_parser)):
        flags = parser().help_text().replace("\n", "\n        ")
        magic.__doc__ = f"{magic.__doc__.rstrip()}\n\n        Flags (also: {parser().prog} -h):\n\n        {flags}\n"


_add_generated_help()


def load_ipython_extension(ipython) -> None:
    """``%load_ext workbench``: register the magics (and the lab panel's comm target), stop the fleet at exit."""
    from workbench.kernel import panel

    magics = WorkbenchMagics(ipython)
    ipython.register_magics(magics)
    panel.register(ipython, magics.session)
    atexit.register(magics.session.stop)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext workbench``: stop the fleet and unregister the magics and the panel's comm target."""
    from workbench.kernel import panel

    magics = ipython.magics_manager.registry.get(WorkbenchMagics.__name__)
    if magics is not None:
        magics.session.stop()
        atexit.unregister(magics.session.stop)
    panel.unregister(ipython)
    for kind, names in WorkbenchMagics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
    ipython.magics_manager.registry.pop(WorkbenchMagics.__name__, None)
