"""Options, defined once: what ``Fleet(...)`` / ``%fleet start`` and ``%%distributed`` accept.

Each option is a field of a keyword-only dataclass, and the string under a field is its
documentation: the magics' flags, defaults, choices and ``%fleet?`` help are generated from
these classes (:mod:`workbench.kernel.flags`), in the style of torchtitan's job config. A field's
``metadata`` says how it appears as a flag where the field name alone does not (``-n``,
``--no-wandb``, a metavar). Checks that need no running fleet are ``validate`` methods, so
bad input is a one-line :class:`OptionsError` before anything starts.

Runs on both sides: engines build :class:`CellOptions` from the kernel's dict.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal, get_args

from workbench.errors import OptionsError, require_whole
from workbench.launcher_kinds import kind_of, launcher_names
from workbench.parallel.data_parallel import data_parallel
from workbench.parallel.options import Schedule, check_parallel
from workbench.parallel.plan import ParallelPlan

Strategy = Literal["ddp", "fsdp", "hsdp", "none"]
Precision = Literal["no", "fp16", "bf16"]
Backend = Literal["gloo", "nccl", "mpi"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
PRECISIONS: tuple[str, ...] = get_args(Precision)
BACKENDS: tuple[str, ...] = get_args(Backend)
DEFAULT_PG_TIMEOUT_S = 300.0
DEFAULT_ENGINE_TIMEOUT_S = 120.0
DEFAULT_HANG_TIMEOUT_S = 300.0


def flag(default, *, name: str | None = None, metavar: str | None = None, api_only: bool = False,
         zero_ok: bool = False, **kwargs):
    """A field with how it appears as a magic flag: ``name`` (``-n``, ``--no-wandb``; a
    ``--no-`` flag stores False), ``metavar``, ``api_only`` (no flag: the Python API only),
    ``zero_ok`` (a number of seconds where 0 means off)."""
    metadata = {"flag": name, "metavar": metavar, "api_only": api_only, "zero_ok": zero_ok}
    return field(default=default, metadata=metadata, **kwargs)


def installed(module: str) -> bool:
    """``module`` can be imported (found without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # None in sys.modules: its import is blocked
        return False


def _choice(value, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise OptionsError(f"unknown {what} {value!r}; use one of: {', '.join(choices)}")


def parse_duration(text, what: str = "--park-after") -> float:
    """``"30m"``, ``"2h"``, ``"90s"`` or a number of seconds -> seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    raw = str(text).strip().lower()
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise OptionsError(f"{what} takes a time like 30m, 2h or 90s (got {text!r})") from None
    if not seconds > 0 or seconds == float("inf"):
        raise OptionsError(f"{what} must be a positive time (got {text!r})")
    return seconds


def parse_size(text, what: str = "--memory-limit") -> int | None:
    """``"4G"``, ``"512M"``, ``"2GiB"`` or a number of bytes → bytes (None stays None)."""
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        raw = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
        try:
            value = int(float(number) * units[unit])
        except ValueError:
            raise OptionsError(f"{what} takes a size like 4G or 512M (got {text!r})") from None
    if value < 2**20:
        raise OptionsError(f"{what} {text!r} is below 1 MiB; write a unit, e.g. 4G")
    return value


@dataclass(frozen=True, kw_only=True)
class CellOptions:
    """How a ``%%distributed`` cell trains: the Accelerator every rank builds from it (see
    :mod:`workbench.parallel` for the parallelism fields)."""

    strategy: Strategy = "ddp"
    """how the model is wrapped: ddp, fsdp (FSDP2, also on CPU), hsdp (shard inside groups, replicate
    across them) or none (nothing wrapped; the rank is still accelerate's distributed environment)"""
    mixed_precision: Precision = "no"
    """autocast precision; fp16 needs a GPU"""
    grad_accum: int = flag(1, metavar="K")
    """gradient accumulation steps"""
    comm_hook: str | None = flag(None, metavar="fp16|bf16|powersgd[:RANK]")
    """DDP gradient compression with torch's communication hooks"""
    mesh: str | None = flag(None, metavar="RxS")
    """hsdp layout REPLICATExSHARD, e.g. 2x2 (default: shard inside a node, replicate across nodes)"""
    tp: int = flag(1, metavar="N")
    """tensor-parallel size (a dp x tp mesh; a model's tp_plan, or nn.Linear pairs of an nn.Sequential)"""
    pp: int = flag(1, metavar="N")
    """pipeline stages, one per rank (an nn.Sequential cut in N; train with model.train_step)"""
    microbatches: int = flag(4, metavar="M")
    """microbatches per pipeline step"""
    schedule: Schedule = "gpipe"
    """pipeline schedule"""
    activation_checkpointing: bool = False
    """recompute each block's activations in backward"""
    fsdp_wrap: str = flag("auto", metavar="auto|none|ClassName[,...]")
    """fsdp/hsdp units: auto (each block, then the root) | none (one unit) | block class names"""

    @property
    def wraps_model(self) -> bool:
        """accelerate wraps the model (DDP or FSDP2); with ``none`` and workbench's own
        parallelism the model is left as it is, but the rank is still distributed."""
        return data_parallel(self.strategy).accelerate_wraps and not self.custom_parallel

    @property
    def custom_parallel(self) -> bool:
        """workbench, not accelerate, shards or splits the model (hsdp, tp, pp)."""
        return data_parallel(self.strategy).own_mesh or self.tp > 1 or self.pp > 1

    def validate(self, device_type: str, world_size: int | None = None, nodes: int = 1,
                 backend: str | None = None) -> "CellOptions":
        """Raise :class:`OptionsError` for a combination that cannot work on ``device_type``
        (and, when ``world_size`` is given, on that many ranks)."""
        _choice(self.strategy, STRATEGIES, "strategy")
        _choice(self.mixed_precision, PRECISIONS, "mixed precision")
        require_whole(self.grad_accum, "--grad-accum", 1)
        if self.mixed_precision == "fp16" and device_type == "cpu":
            raise OptionsError(
                "fp16 mixed precision needs a GPU (it relies on CUDA's grad scaler); "
                "on CPU use --mixed-precision bf16 or no"
            )
        if self.fsdp_wrap != "auto":
            from workbench.parallel.fsdp import parse_wrap

            parse_wrap(self.fsdp_wrap)
            if not data_parallel(self.strategy).chooses_units:
                raise OptionsError(f"--fsdp-wrap chooses FSDP units: use it with --strategy fsdp or hsdp "
                                   f"(not {self.strategy})")
        if world_size is None:
            check_parallel(self, None, nodes, backend)
        else:  # the degrees too: their product is the world
            ParallelPlan.of(self, world_size, nodes, backend)
        return self

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class CellCall:
    """Where and how long one ``%%distributed`` cell runs (not how it trains)."""

    ranks: list[int] | None = flag(None, metavar="0,1")
    """run on these ranks only"""
    timeout: float | None = flag(None, metavar="S")
    """stop the cell after S seconds"""
    setup: bool = False
    """record the cell (model, optimizer, data): replayed on every rank after %fleet scale or a recovery"""
    show_all_progress: bool = False
    """show every rank's progress bars (tqdm and the like); by default only the first rank's, the
    others' are in the rank logs"""
    stop_on_nan: bool = False
    """stop the cell at the first NaN or infinite value a rank logs with workbench.log ('loss is nan at step
    412 on rank 1'); logged tensors are then read at once (on a GPU: a sync per log call)"""


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """What ``workbench.tune`` / ``%fleet tune`` tries: each strategy x precision x micro-batch
    size, a short trial each (:mod:`workbench.trials`)."""

    micro_batches: list[int] | None = flag(None, metavar="8,16,32")
    """micro-batch sizes per rank, smallest first; running out of memory ends a series (default: 1, 2, 4, ...
    up to the global batch per rank, or to 64)"""
    global_batch: int | None = flag(None, metavar="N")
    """samples per optimizer step over all ranks, kept by gradient accumulation (micro-batch x accumulation
    x ranks); default: no accumulation"""
    strategies: list[str] | None = flag(None, metavar="ddp,fsdp")
    """strategies to try (default: ddp,fsdp, plus hsdp on more than one node)"""
    precisions: list[str] | None = flag(None, metavar="no,bf16")
    """mixed precisions to try (default: no, plus bf16 on a GPU)"""
    steps: int = flag(5, metavar="K")
    """timed optimizer steps per trial"""
    warmup: int = flag(2, metavar="K")
    """optimizer steps per trial before the timing starts"""
    max_memory: str | int | None = flag(None, metavar="SIZE")
    """a trial whose peak memory on a rank is over this counts as out of memory, e.g. 8G (default: only a real
    out-of-memory error)"""
    tokens_per_sample: int | None = flag(None, metavar="T")
    """tokens in one sample (e.g. the sequence length): adds tokens/s to the table"""
    apply: bool = flag(True, name="--no-apply")
    """only show the table (default: the fastest configuration becomes the defaults of the next cells)"""

    def validate(self, device_type: str, world_size: int, nodes: int = 1) -> "TuneOptions":
        """Raise :class:`OptionsError` for values no trial can use; returns the options with the
        defaults filled in for this fleet (``micro_batches``, ``strategies``, ``precisions``)."""
        require_whole(self.steps, "--steps", 1)
        require_whole(self.warmup, "--warmup", 0)
        if self.global_batch is not None:
            require_whole(self.global_batch, "--global-batch", 1)
        if self.tokens_per_sample is not None:
            require_whole(self.tokens_per_sample, "--tokens-per-sample", 1)
        parse_size(self.max_memory, "--max-memory")
        for size in self.micro_batches or ():
            require_whole(size, "a micro-batch size", 1)
        for strategy in self.strategies or ():
            _choice(strategy, ("ddp", "fsdp", "hsdp"), "strategy to tune")
        for precision in self.precisions or ():
            _choice(precision, PRECISIONS, "mixed precision")
        per_rank = self.global_batch // world_size if self.global_batch else 64
        sizes = sorted(set(self.micro_batches or [2**i for i in range(per_rank.bit_length()) if 2**i <= per_rank]))
        if self.global_batch:
            sizes = [s for s in sizes if self.global_batch % (s * world_size) == 0]
            if not sizes:
                raise OptionsError(f"no micro-batch size divides --global-batch {self.global_batch} over {world_size} "
                                   "ranks (micro-batch x accumulation x ranks must equal it)")
        strategies = self.strategies or ["ddp", "fsdp"] + (["hsdp"] if nodes > 1 else [])
        precisions = self.precisions or ["no"] + (["bf16"] if device_type == "cuda" else [])
        return replace(self, micro_batches=sizes, strategies=list(strategies), precisions=list(precisions))


@dataclass(kw_only=True)
class FleetOptions:
    """How a fleet is started: the keyword arguments of ``Fleet(...)`` and the flags of
    ``%fleet start``."""

    n: int | None = flag(None, name="-n", metavar="N")
    """number of engines (default: one per GPU, or 2 on CPU)"""
    name: str | None = flag(None, metavar="NAME")
    """the run's name in run.json, wandb and the panel (default: the notebook's name, else the run id)"""
    gpus: str | list[str] | None = flag(None, metavar="0,2")
    """GPU ids, one engine each"""
    cpu: bool = False
    """CPU engines even if GPUs are visible"""
    backend: Backend | None = None
    """process group backend (default: gloo on CPU, nccl on GPU)"""
    pg_timeout: float = flag(DEFAULT_PG_TIMEOUT_S, metavar="S")
    """seconds after which a blocked collective fails"""
    engine_timeout: float = flag(DEFAULT_ENGINE_TIMEOUT_S, metavar="S")
    """seconds the engines get to start and register"""
    hang_timeout: float | None = flag(DEFAULT_HANG_TIMEOUT_S, metavar="S", zero_ok=True)
    """a rank with no heartbeat, or no progress, this many seconds is hung and stopped (0: off)"""
    auto_recover: bool = False
    """when an engine dies or hangs in a cell: recover and run the cell again"""
    max_restarts: int = flag(3, metavar="K")
    """auto-recover budget (also spent by --auto-replace-stragglers)"""
    auto_replace_stragglers: bool = False
    """after a cell that showed a slow rank (see %fleet status), replace it, keeping the training state"""
    spares: int = flag(0, metavar="K")
    """warm engines kept ready outside the group: scale up and recovery take one at once"""
    memory_limit: str | int | None = flag(None, metavar="SIZE")
    """per engine, e.g. 4G (CPU: address space; GPU: share of its GPU memory)"""
    wandb: bool | None = flag(None, name="--no-wandb")
    """do not log this run to wandb (default: offline wandb when it is installed)"""
    tensorboard: bool | None = flag(None, name="--no-tensorboard")
    """do not write TensorBoard event files (default: on when tensorboard is installed)"""
    sinks: list[str] | None = flag(None, name="--sink", metavar="NAME[,NAME]")
    """more places for the run's records: sinks by the name they were registered under (register_sink in
    workbench.kernel.metrics.sinks, or a 'workbench.sinks' entry point)"""
    checkpoint_dir: str | None = flag(None, metavar="DIR|URL")
    """where checkpoints go: a folder (shared by every host) or an fsspec URL such as s3://bucket/prefix (default:
    the run's folder); later fleets given the same place can restore what earlier ones saved"""
    runs_dir: str | None = flag(None, metavar="DIR")
    """where run folders go (default ./workbench-runs)"""
    launcher: str = flag("local", metavar="local|mpi|slurm|pbs|ssh|...")
    """how engines start: here, or through any of ipyparallel's launchers (mpi, slurm, pbs, ssh, sge, lsf,
    htcondor, ...)"""
    launcher_options: dict = flag(None, name="--launcher-option", metavar="KEY=VALUE")
    """an option of the launcher, by its ipyparallel name (repeatable)"""
    launcher_config: str | None = flag(None, metavar="FILE")
    """a traitlets config file for the launcher"""
    hosts: str | None = flag(None, metavar="HOST:N,...")
    """with --launcher ssh or slurm: start the ranks on these hosts in order, N on each (default -n: their
    slots); Slurm starts each host's ranks as one job"""
    hostfile: str | None = flag(None, metavar="FILE")
    """like --hosts, from a file: one 'HOST slots=N' (or HOST:N) a line"""
    ranks_per_node: int | None = flag(None, metavar="K")
    """with --launcher slurm and no --hosts: K ranks in each node's job (default: a node's GPUs, as sinfo
    reports them, else its CPUs); Slurm picks the nodes, never a lost one"""
    master_addr: str | None = flag(None, metavar="ADDR")
    """the address the other ranks reach rank 0 at (default: rank 0's address on the interface that reaches
    the other hosts)"""
    partition: str | None = None
    """batch partition (slurm/pbs)"""
    time: str | None = None
    """batch time limit (slurm/pbs)"""
    account: str | None = None
    """batch account (slurm/pbs)"""
    qos: str | None = None
    """batch quality of service (slurm/pbs)"""
    profile: str | None = flag(None, metavar="NAME")
    """attach to a running ipcluster of this profile"""
    cluster_id: str | None = flag(None, metavar="ID")
    """attach to the running ipcluster with this id"""
    park_after: str | float | None = flag(None, metavar="TIME")
    """park the fleet after this long without a command, e.g. 30m (engines stopped, GPUs free; the next cell
    brings it back); not when rank 0 holds names no setup cell makes, unless --park-anyway"""
    park_anyway: bool = False
    """--park-after parks even when rank 0 holds names that no setup cell makes (they are lost)"""
    progress: bool = flag(True, api_only=True)
    """show a progress line while the fleet starts, scales and recovers"""

    @classmethod
    def build(cls, n: int | None, options: "FleetOptions | None", kwargs: dict) -> "FleetOptions":
        """``Fleet(n, **kwargs)`` or ``Fleet(options=...)`` as validated options (an unknown
        keyword is a one-line error with the nearest option's name)."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                raise OptionsError(f"Fleet() has no option {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                                   + f" (options: {', '.join(names)})")
        if options is not None:
            return replace(options, **({"n": n} if n is not None else {}), **kwargs).validate()
        return cls(n=n, **kwargs).validate()

    @property
    def attached(self) -> bool:
        """The engines are those of an ipcluster that is already running (not ours)."""
        return self.profile is not None or self.cluster_id is not None

    def placement(self):
        """The hosts of ``--hosts`` / ``--hostfile`` (a :class:`~workbench.placement.Hosts`), or None."""
        from workbench.placement import Hosts

        if self.hosts and self.hostfile:
            raise OptionsError("give --hosts or --hostfile, not both")
        if self.hosts:
            return Hosts.parse(self.hosts)
        return Hosts.read(self.hostfile) if self.hostfile else None

    def batch_options(self) -> dict:
        """``launcher_options`` plus the batch shortcuts that were set."""
        shortcuts = {k: getattr(self, k) for k in ("partition", "time", "account", "qos") if getattr(self, k)}
        return {**(self.launcher_options or {}), **shortcuts}

    def validate(self) -> "FleetOptions":
        """Raise :class:`OptionsError` for a value that cannot work (one line, nothing started)."""
        if self.backend is not None and self.backend not in BACKENDS and ":" not in self.backend:
            raise OptionsError(f"unknown backend {self.backend!r}; use one of: {', '.join(BACKENDS)}")
        if self.park_after is not None:
            parse_duration(self.park_after)
        if self.pg_timeout <= 0:
            raise OptionsError(f"--pg-timeout must be a positive number of seconds (got {self.pg_timeout})")
        require_whole(self.max_restarts, "--max-restarts", 0)
        require_whole(self.spares, "--spares", 0)
        if self.hang_timeout is not None and self.hang_timeout < 0:
            raise OptionsError(f"--hang-timeout must be >= 0 seconds, 0 to turn it off (got {self.hang_timeout})")
        _choice(self.launcher, launcher_names(), "launcher")
        kind = kind_of(self.launcher)
        if self.wandb and not installed("wandb"):
            raise OptionsError("wandb=True needs the wandb package: pip install 'torch-workbench[wandb]'")
        hosts = self.placement()
        if hosts is not None:
            if not kind.placed_by_hosts:
                raise OptionsError("--hosts/--hostfile place engines with --launcher ssh or slurm (PBS and MPI "
                                   "place them through their own allocation)")
            if self.n is None:
                return replace(self, n=hosts.total).validate()
            if self.n > hosts.total:
                raise OptionsError(f"-n {self.n} needs {self.n} slots but the hosts have {hosts.total} ({hosts})")
        if self.ranks_per_node is not None:
            if not kind.node_jobs or hosts is not None:
                raise OptionsError("--ranks-per-node sizes the jobs of --launcher slurm when Slurm picks the nodes "
                                   "(without --hosts, which says the ranks of each host)")
            require_whole(self.ranks_per_node, "--ranks-per-node", 1)
        if self.launcher != "local" or self.attached:
            if self.gpus:
                raise OptionsError("--gpus picks GPUs of this machine; with a cluster launcher the scheduler "
                                   "assigns them (each engine takes the GPU of its local rank)")
            if self.n is None and not self.attached:
                raise OptionsError(f"--launcher {self.launcher} needs -n (how many engines to start)")
            if self.n is not None:
                require_whole(self.n, "-n", 1)
        return self
