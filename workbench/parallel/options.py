"""One-line refusals of parallelism flags that cannot work, before anything runs."""

from __future__ import annotations

from typing import Literal, get_args

from workbench.errors import OptionsError, require_whole
from workbench.parallel.data_parallel import data_parallel

COMM_HOOKS = ("fp16", "bf16", "powersgd")
Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


def parse_comm_hook(text: str) -> tuple[str, int]:
    """``fp16`` / ``bf16`` / ``powersgd[:RANK]`` → (name, PowerSGD rank; 1 by default)."""
    name, _, rank = text.lower().partition(":")
    if name not in COMM_HOOKS:
        raise OptionsError(f"unknown --comm-hook {text!r}; use one of: fp16, bf16, powersgd[:RANK]")
    if rank and name != "powersgd":
        raise OptionsError(f"--comm-hook {name} takes no rank (only powersgd:RANK does)")
    try:
        value = int(rank) if rank else 1
    except ValueError:
        value = 0
    if value < 1:
        raise OptionsError(f"--comm-hook powersgd:RANK needs a whole number >= 1 (got {rank!r})")
    return name, value


def check_parallel(options, world: int | None, nodes: int = 1, backend: str | None = None) -> None:
    """Raise :class:`OptionsError` for parallelism flags that do not fit together or the world."""
    chosen = data_parallel(options.strategy)
    require_whole(options.tp, "--tp", 1)
    require_whole(options.pp, "--pp", 1)
    require_whole(options.microbatches, "--microbatches", 1)
    if options.comm_hook is not None:
        parse_comm_hook(options.comm_hook)
        if not chosen.takes_comm_hook or options.custom_parallel:
            raise OptionsError("--comm-hook compresses DDP's gradient all-reduce: use it with --strategy ddp only "
                               "(FSDP/HSDP reduce-scatter and TP/PP have no DDP buckets)")
        if backend == "gloo" and options.comm_hook.lower().startswith("powersgd"):
            # torch's powerSGD_hook waits on gloo work inside future callbacks: with layers large enough
            # to be compressed (e.g. 1024x256) a rank dies or the group hangs, also under torchrun
            raise OptionsError("--comm-hook powersgd needs nccl: on gloo torch's PowerSGD hook crashes or hangs "
                               "ranks once it compresses; on CPU use --comm-hook fp16 or bf16")
    if options.schedule not in SCHEDULES:
        raise OptionsError(f"unknown --schedule {options.schedule!r}; use one of: {', '.join(SCHEDULES)}")
    if options.mesh is not None:
        if not chosen.takes_mesh:
            raise OptionsError("--mesh RxS is the hsdp layout (replicate x shard); use it with --strategy hsdp "
                               "(--tp N sets the tensor-parallel mesh)")
        replicate, _, shard = options.mesh.lower().partition("x")
        if not (replicate.isdigit() and shard.isdigit() and int(replicate) >= 1 and int(shard) >= 1):
            raise OptionsError(f"--mesh takes REPLICATExSHARD, e.g. --mesh 2x2 (got {options.mesh!r})")
    if options.custom_parallel and options.mixed_precision == "fp16":
        raise OptionsError("--mixed-precision fp16 is not supported with hsdp, --tp or --pp; use bf16")
    if sum([chosen.own_mesh, options.tp > 1, options.pp > 1]) > 1:
        raise OptionsError("combine at most one of --strategy hsdp, --tp and --pp in a cell")
    if options.pp > 1 and not chosen.takes_stages:
        raise OptionsError(f"--pp puts one stage on each rank; --strategy {options.strategy} cannot shard a stage too")
    if (options.pp > 1 or options.tp > 1) and options.mixed_precision != "no":
        raise OptionsError("--tp and --pp run in full precision for now; drop --mixed-precision "
                           "(hsdp takes --mixed-precision bf16)")
    if options.schedule == "1f1b" and options.microbatches < options.pp:
        raise OptionsError(f"--schedule 1f1b needs at least as many microbatches as stages "
                           f"(--microbatches {options.microbatches} < --pp {options.pp})")
    if world is None:
        return
    if options.tp > world:
        raise OptionsError(f"--tp {options.tp} is larger than the world ({world} ranks)")
    if world % options.tp:
        raise OptionsError(f"--tp {options.tp} does not divide the world of {world} ranks")
    if options.tp > 1 and world // options.tp > 1 and not chosen.shards_beside_tp:
        raise OptionsError(f"--tp {options.tp} on {world} ranks leaves a data-parallel dimension of "
                           f"{world // options.tp}: shard it with --strategy fsdp")
    if options.pp > 1 and options.pp != world:
        raise OptionsError(f"--pp {options.pp} must equal the world size ({world}): one stage per rank")
