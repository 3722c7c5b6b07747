"""What runs inside each engine process: the rank's state and the cell runner.

The kernel calls these functions through ipyparallel ``apply``; they run in
the engine's IPython namespace, which persists across cells.
"""

from __future__ import annotations

import ast
import linecache
import sys
import traceback
from typing import Any

from .metrics.logger import LOGGER
from .strategies import CellOptions


class RankState:
    """This engine's place in the fleet, and the Accelerator of the last cell."""

    def __init__(self) -> None:
        self.spec = None
        self.device = None
        self.accelerator = None
        self.accelerator_key = None
        self.pg_sockets: set = set()  # (local, remote) addresses of the group's connections
        self.group = None  # the default process group workbench made (user code may destroy or replace it)
        self.cells = 0
        self.run_dir: str | None = None  # the fleet run's folder (checkpoints live under it)
        self.in_user_code = False
        self.memory_limit: int | None = None  # bytes (--memory-limit)

    def joined(self, spec, device, pg_sockets: set, group) -> None:
        self.spec, self.device, self.pg_sockets, self.group = spec, device, pg_sockets, group
        self.accelerator = self.accelerator_key = None

    def left(self) -> None:
        self.spec, self.pg_sockets, self.group = None, set(), None
        self.accelerator = self.accelerator_key = None

    def group_intact(self) -> bool:
        """Whether the default process group is still the one workbench made (a cell may have
        destroyed it, e.g. through accelerate's ``destroy_process_group``, or made its own)."""
        torch = sys.modules.get("torch")
        if self.group is None or torch is None:
            return self.group is None
        import torch.distributed as dist

        return dist.is_initialized() and dist.distributed_c10d._get_default_group() is self.group

    def ensure_accelerator(self, options: CellOptions):
        """The Accelerator for ``options``, rebuilt when options or process group change."""
        if self.spec is None:
            raise RuntimeError("this engine has no process group; run %fleet start again")
        key = (options, self.spec.generation)
        if self.accelerator is None or self.accelerator_key != key or _accelerate_state_reset():
            from .strategies import build_accelerator

            nodes = self.spec.world_size // max(1, self.spec.local_world_size)
            self.accelerator = build_accelerator(options, self.device.type, nodes)
            self.accelerator_key = key
        return self.accelerator

    def names(self, options: CellOptions) -> dict:
        """The names every ``%%distributed`` cell sees."""
        import workbench

        return {
            "accelerator": self.ensure_accelerator(options),
            "rank": self.spec.rank,
            "world_size": self.spec.world_size,
            "local_rank": self.spec.local_rank,
            "device": self.device,
            "mesh": self.ensure_accelerator(options).workbench_mesh,  # hsdp / --tp / --pp, else None
            "workbench": workbench,
        }


STATE = RankState()


def _accelerate_state_reset() -> bool:
    """accelerate's singletons were cleared since the Accelerator was built (user code called
    ``AcceleratorState._reset_state``, as accelerate's own test utilities do)."""
    from accelerate.state import AcceleratorState, PartialState

    return not PartialState._shared_state or not AcceleratorState._shared_state


def _interrupt_user_code(signum, frame) -> None:
    """SIGINT on an engine: interrupts the user's code, never workbench's own bookkeeping
    (a late interrupt that lands after the code ended must not break the reply)."""
    if STATE.in_user_code:
        raise KeyboardInterrupt


class _UserCode:
    def __enter__(self):
        import signal

        signal.signal(signal.SIGINT, _interrupt_user_code)  # ipykernel restores its own after the request
        STATE.in_user_code = True

    def __exit__(self, *exc):
        STATE.in_user_code = False


def _namespace() -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    return shell.user_ns if shell is not None else sys.modules["__main__"].__dict__


def _failure(exc: BaseException, skip_frames: int) -> dict:
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    evalue = str(exc)
    if _over_memory_limit(exc):
        note = (f"this rank's memory limit ({STATE.memory_limit / 2**30:.3g} GiB, --memory-limit) was reached; "
                "lower the batch or model size, or raise the limit")
        evalue, text = f"{evalue} [{note}]", f"{text.rstrip()}\nMemoryLimit: {note}\n"
    return {"ok": False, "ename": type(exc).__name__, "evalue": evalue, "traceback": text}


def _over_memory_limit(exc: BaseException) -> bool:
    if STATE.memory_limit is None:
        return False
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def limit_memory(limit: int | None, cpu: bool = True) -> None:
    """``--memory-limit``: on a CPU engine its address space (``RLIMIT_AS``: allocations past it
    fail with MemoryError, the process lives on); on a GPU engine, once it has its GPU, its
    share of that GPU's memory (``torch.cuda.set_per_process_memory_fraction``; an address
    space limit would break CUDA's large mappings)."""
    import resource

    STATE.memory_limit = limit
    if limit is not None and cpu:
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    apply_memory_limit()


def apply_memory_limit() -> None:
    """The GPU half of :func:`limit_memory`, once the rank's device is known."""
    torch = sys.modules.get("torch")
    if STATE.memory_limit is None or torch is None or STATE.device is None or STATE.device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(STATE.device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, STATE.memory_limit / total), STATE.device)


def _format(value: Any) -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return {"text/plain": repr(value)}
    data, _metadata = shell.display_formatter.format(value)
    return data


def _compile_cell(code: str, filename: str):
    """Compile ``code`` like IPython does: the last expression's value is kept."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        code = shell.transform_cell(code)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)


def run_cell(
    code: str, options: dict, cell_name: str, return_value: bool = False, display_value: bool = True
) -> dict:
    """Run a ``%%distributed`` cell on this rank.

    Returns ``{"ok": True, "value": ..., "display": mimebundle}`` or a failure
    record with the traceback of the user's code only.
    """
    STATE.cells += 1
    ns = _namespace()
    try:
        ns.update(STATE.names(CellOptions(**options)))
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel as this rank's error
        return _failure(exc, skip_frames=0)
    filename = f"<{cell_name}>"
    LOGGER.cell_started()
    try:
        body, last = _compile_cell(code, filename)
        with _UserCode():
            exec(body, ns)
            value = eval(last, ns) if last is not None else None
    except BaseException as exc:  # noqa: BLE001
        return _with_metrics(_failure(exc, skip_frames=1))
    result = {"ok": True, "value": None, "display": None}
    if value is not None:
        ns["_"] = value
        if return_value:
            result["value"] = to_cpu(value)
        if display_value:
            result["display"] = _format(value)
    return _with_metrics(result)


def run_function(fn, args: tuple, kwargs: dict, options: dict) -> dict:
    """Call ``fn(*args, **kwargs)`` on this rank, with the cell names defined."""
    ns = _namespace()
    try:
        ns.update(STATE.names(CellOptions(**options)))
        LOGGER.cell_started()
        with _UserCode():
            value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        return _with_metrics(_failure(exc, skip_frames=1))
    return _with_metrics({"ok": True, "value": to_cpu(value), "display": None})


def _with_metrics(reply: dict) -> dict:
    """Add how many metrics records this rank sent (the kernel waits for them), and
    errors of background checkpoint saves (reported once, never lost)."""
    import os

    from .checkpoint.api import take_errors, wait_for_staging

    wait_for_staging()  # the next cell may change parameters in place
    LOGGER.cell_finished()
    reply["group_intact"] = STATE.group_intact()
    reply["metrics"] = {"pid": os.getpid(), "seq": LOGGER.flush(), "cell": LOGGER.cells}
    errors = take_errors()  # every rank has the same failure (DCP is collective); rank 0 reports it once
    reply["notices"] = errors if STATE.spec is not None and STATE.spec.rank == 0 else []
    if LOGGER.send_error is not None:  # the sender survived it; say so once
        rank = STATE.spec.rank if STATE.spec is not None else "?"
        reply["notices"].append(f"rank {rank}: the metrics sender skipped a message ({LOGGER.send_error})")
        LOGGER.send_error = None
    return reply


def call(fn, args: tuple, kwargs: dict) -> dict:
    """Call a workbench function on this rank as the kernel's request (no cell names set)."""
    try:
        with _UserCode():
            value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        return _failure(exc, skip_frames=1)
    return {"ok": True, "value": to_cpu(value), "display": None}


def warm() -> None:
    """A spare engine: import what a rank needs now, so that taking a rank is quick."""
    import accelerate  # noqa: F401
    import torch._dynamo  # noqa: F401 - FSDP2 and accelerate's prepare import it at first use (0.4 s)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    from . import checkpoint, strategies  # noqa: F401


def attach(metrics_address: str, run_dir: str, memory_limit: int | None = None, cpu: bool = True) -> None:
    """Join the fleet run: metrics go to the kernel's collector, checkpoints under ``run_dir``,
    and ``memory_limit`` bytes at most (:func:`limit_memory`)."""
    STATE.run_dir = run_dir
    LOGGER.attach(metrics_address)
    limit_memory(memory_limit, cpu)


def to_cpu(value: Any) -> Any:
    """Tensors (also inside lists, tuples and dicts) moved to CPU for the kernel."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor":
            # gathering would be a collective; a pull from one rank gets its shard
            value = value.to_local()
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def pull(name: str) -> dict:
    """The value of ``name`` in this rank's namespace, tensors moved to CPU."""
    ns = _namespace()
    if name not in ns:
        return {"ok": False, "ename": "NameError", "evalue": f"name {name!r} is not defined on this rank",
                "traceback": ""}
    return {"ok": True, "value": to_cpu(ns[name]), "display": None}


def memory_report() -> str:
    """This rank's resident memory, plus CUDA memory allocated when on a GPU."""
    import psutil

    text = f"{psutil.Process().memory_info().rss / 2**20:.0f} MiB"
    torch = sys.modules.get("torch")
    if torch is not None and STATE.device is not None and STATE.device.type == "cuda":
        text += f" (cuda {torch.cuda.memory_allocated(STATE.device) / 2**20:.0f} MiB)"
    return text


def set_step(step: int) -> None:
    """Set this rank's ``workbench.step`` (all ranks agree on it after a recovery)."""
    LOGGER.step = int(step)


def push(values: dict) -> None:
    """Set ``values`` in this rank's namespace."""
    _namespace().update(values)
