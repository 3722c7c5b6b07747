"""Engine side: throughput trials of the user's training step (``workbench.tune``).

A trial builds the Accelerator of one configuration (strategy, mixed precision, gradient
accumulation), prepares a fresh copy of the model and a new optimizer with it, runs a few
optimizer steps on a batch of one micro-batch size, and measures samples/s and peak memory
on every rank; the slowest rank and the largest peak count (training is synchronous). Running
out of memory is a result: that size and the larger ones of its series are marked, not run.

Nothing a trial does stays: the model is copied (or built by the user's function), random
number generators, ``workbench.step`` and the run's metrics are as before, and the cell's
Accelerator is rebuilt afterwards. Every rank must call :func:`tune` (trials are collective).
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from workbench.errors import OptionsError
from workbench.metrics.logger import LOGGER
from workbench.options import CellOptions, TuneOptions, parse_size
from workbench.rank_state import STATE, is_out_of_memory, namespace

OUT_OF_MEMORY = "out of memory"
OVER_MAX_MEMORY = "over --max-memory"


@dataclass(frozen=True)
class Trial:
    """One configuration and what it measured (``samples_per_s`` over all ranks)."""

    strategy: str
    precision: str
    micro_batch: int
    grad_accum: int
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory: int | None = None
    """bytes, the largest rank's: on a GPU the most torch allocated, on CPU the peak resident memory"""
    status: str = "ok"
    """ok, out of memory, over --max-memory, or skipped: why"""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def cell_options(self, base: CellOptions | None = None) -> CellOptions:
        """``base`` (default: the defaults) with this trial's strategy, precision and accumulation."""
        return replace(base or CellOptions(), strategy=self.strategy, mixed_precision=self.precision,
                       grad_accum=self.grad_accum)

    def flags(self) -> str:
        """The ``%%distributed`` flags of this configuration."""
        return f"--strategy {self.strategy} --mixed-precision {self.precision} --grad-accum {self.grad_accum}"


@dataclass(frozen=True)
class TuneResult:
    """Every trial of :func:`tune`, in the order run; :attr:`best` is the fastest that fit."""

    trials: list[Trial]
    world_size: int

    @property
    def best(self) -> Trial | None:
        fitting = [t for t in self.trials if t.ok]
        return max(fitting, key=lambda t: t.samples_per_s) if fitting else None

    def table(self) -> str:
        tokens = any(t.tokens_per_s for t in self.trials)
        header = ["strategy", "precision", "micro-batch", "accum", "samples/s"] + (["tokens/s"] if tokens else [])
        rows = [header + ["peak memory", "result"]]
        best = self.best
        for t in self.trials:
            rate = [f"{t.samples_per_s:,.1f}" if t.samples_per_s else "-"]
            if tokens:
                rate.append(f"{t.tokens_per_s:,.0f}" if t.tokens_per_s else "-")
            memory = f"{t.peak_memory / 2**20:,.0f} MiB" if t.peak_memory else "-"
            mark = "  <- fastest" if t is best else ""
            rows.append([t.strategy, t.precision, str(t.micro_batch), str(t.grad_accum), *rate, memory,
                         t.status + mark])
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) + 2)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.table())


def tune(step: Callable | str, model: Any, batch: Callable | str, optimizer: Callable | str | None = None,
         options: TuneOptions | None = None, **option_values) -> TuneResult:
    """Short trials of a training step over micro-batch sizes, gradient accumulation (keeping
    ``global_batch``), strategies and mixed precisions; returns the table (every rank gets the same).

    Call it on every rank (in a ``%%distributed`` cell; ``%fleet tune`` also applies the result):

    - ``step(model, batch) -> loss``: the forward part of the training step; the trial adds
      ``accelerator.backward``, the optimizer step and accumulation the way accelerate does;
    - ``model``: a function that builds the model, or a model (copied per trial, so it is never
      changed; a sharded model needs the function);
    - ``batch(size) -> batch``: a batch of ``size`` samples (tensors, or lists / dicts of them);
    - ``optimizer(params)``: the optimizer to use (default ``torch.optim.AdamW``).

    Each may also be the name of one in this rank's namespace. The rest are
    :class:`~workbench.options.TuneOptions` fields (``micro_batches=[8, 16]``, ``global_batch=64``,
    ``strategies=["ddp", "fsdp"]``, ``precisions``, ``steps``, ``warmup``, ``max_memory``,
    ``tokens_per_sample``; ``apply`` is for ``%fleet tune``: here nothing is applied).
    """
    if STATE.spec is None:
        raise RuntimeError("workbench.tune runs on the ranks of a fleet: call it in a %%distributed cell")
    options = replace(options, **option_values) if options is not None else TuneOptions(**option_values)
    nodes = STATE.spec.nodes
    options = options.validate(STATE.device.type, STATE.spec.world_size, nodes)
    step, batch = _named(step, "step"), _named(batch, "batch")
    build = _model_builder(_named(model, "model"))
    make_optimizer = _named(optimizer, "optimizer") if optimizer is not None else _adamw
    cell = STATE.accelerator.workbench_options if STATE.accelerator is not None else None
    plan = _plan(options, nodes)
    trials: list[Trial] = []
    random_state = _random_state()
    try:
        with LOGGER.suspended():
            series_end: dict[tuple[str, str], int] = {}
            for number, trial in enumerate(plan, 1):
                key = (trial.strategy, trial.precision)
                if key in series_end:
                    trial = replace(trial, status=f"skipped: {series_end[key]} was already too big")
                else:
                    trial = _run(trial, step, build, make_optimizer, batch, options, nodes)
                    if trial.status in (OUT_OF_MEMORY, OVER_MAX_MEMORY):
                        series_end[key] = trial.micro_batch
                trials.append(trial)
                _say(f"tune {number}/{len(plan)}: {_describe(trial)}")
    finally:
        _restore_random_state(random_state)
        _restore_cell_accelerator(cell)
    return TuneResult(trials, STATE.spec.world_size)


def _plan(options: TuneOptions, nodes: int) -> list[Trial]:
    """Every configuration to try, each series (strategy, precision) smallest micro-batch first."""
    world = STATE.spec.world_size
    plan = []
    for strategy, precision in itertools.product(options.strategies, options.precisions):
        for size in options.micro_batches:
            accum = options.global_batch // (size * world) if options.global_batch else 1
            trial = Trial(strategy, precision, size, accum)
            try:
                trial.cell_options().validate(STATE.device.type, world, nodes, STATE.spec.backend)
            except OptionsError as exc:
                trial = replace(trial, status=f"skipped: {exc}")
            plan.append(trial)
    return plan


def _run(trial: Trial, step, build, make_optimizer, batch, options: TuneOptions, nodes: int) -> Trial:
    """One trial on this rank, then every rank's slowest time, largest peak and any failure."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import send_to_device

    from workbench.rank.strategies import build_accelerator

    device = STATE.device
    accelerator = build_accelerator(trial.cell_options(), device.type, nodes)
    model = optimizer = data = None
    elapsed, failed = 0.0, False
    _reset_peak_memory(device)
    try:
        model = build()
        optimizer = make_optimizer(model.parameters())
        model, optimizer = accelerator.prepare(model, optimizer)
        data = send_to_device(batch(trial.micro_batch), accelerator.device)
        start = time.perf_counter()
        for done in range(options.warmup + options.steps):
            if done == options.warmup:
                _synchronize(device)
                start = time.perf_counter()
            for _ in range(trial.grad_accum):
                with accelerator.accumulate(model):
                    accelerator.backward(step(model, data))
                    optimizer.step()
                    optimizer.zero_grad()
        _synchronize(device)
        elapsed = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - only running out of memory is a result
        if not is_out_of_memory(exc):
            raise
        failed = True
    finally:
        del model, optimizer, data
        accelerator.free_memory()  # drops its references to what it prepared; collects garbage
        gc.collect()
    peak = _peak_memory(device)
    summary = torch.tensor([elapsed, float(peak), float(failed)], dtype=torch.float64, device=accelerator.device)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    elapsed, peak, failed = summary.tolist()
    trial = replace(trial, peak_memory=int(peak))
    if failed:
        return replace(trial, status=OUT_OF_MEMORY)
    limit = parse_size(options.max_memory, "--max-memory")
    if limit is not None and peak > limit:
        return replace(trial, status=OVER_MAX_MEMORY)
    rate = trial.micro_batch * trial.grad_accum * STATE.spec.world_size * options.steps / max(elapsed, 1e-9)
    return replace(trial, samples_per_s=rate,
                   tokens_per_s=rate * options.tokens_per_sample if options.tokens_per_sample else None)


def _named(value, what: str):
    """A function, or the name of one in this rank's namespace."""
    if isinstance(value, str):
        ns = namespace()
        if value not in ns:
            raise OptionsError(f"tune: {what} {value!r} is not defined on rank {STATE.spec.rank}; define it in a "
                               "%%distributed cell first")
        value = ns[value]
    return value


def _model_builder(model) -> Callable:
    """A function that returns a fresh model for each trial."""
    import copy

    import torch

    if isinstance(model, torch.nn.Module):
        base = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        if any(type(p).__name__ == "DTensor" for p in base.parameters()):
            raise OptionsError("tune: this model is sharded (fsdp, hsdp or --tp), so it cannot be copied into "
                               "another strategy; pass the function that builds it as model=")
        return lambda: copy.deepcopy(base)
    if not callable(model):
        raise OptionsError(f"tune: model= takes a model or a function that builds one (got {type(model).__name__})")
    return model


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-4)


def _random_state() -> dict:
    import random

    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _restore_random_state(state: dict) -> None:
    import random

    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _restore_cell_accelerator(options: CellOptions | None) -> None:
    """Trials rebuilt accelerate's process-wide state; the cell's ``accelerator`` is built again
    (with its own options), and the next cell builds its own."""
    from workbench.rank.engine import ensure_accelerator

    STATE.accelerator = None
    if options is not None:
        namespace()["accelerator"] = ensure_accelerator(options)


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _reset_peak_memory(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the peak resident set size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_memory(device) -> int:
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss


def _describe(trial: Trial) -> str:
    what = (f"{trial.strategy}, precision {trial.precision}, micro-batch {trial.micro_batch}, "
            f"accumulation {trial.grad_accum}")
    if not trial.ok:
        return f"{what}: {trial.status}"
    return f"{what}: {trial.samples_per_s:,.1f} samples/s, peak {trial.peak_memory / 2**20:,.0f} MiB"


def _say(line: str) -> None:
    if STATE.spec.rank == 0:
        print(line, flush=True)
