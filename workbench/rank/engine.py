"""What runs inside each engine process: the cell runner, and the Accelerator each cell gets.

The kernel calls these functions through ipyparallel ``apply``; they run in
the engine's IPython namespace, which persists across cells.
"""

from __future__ import annotations

import ast
import linecache
import os
import runpy
import sys
import traceback
from typing import Any

from workbench.messages import CellReply, MetricsMark
from workbench.metrics.logger import LOGGER, take_config
from workbench.options import CellOptions
from workbench.rank import batch_process, stacks
from workbench.rank_state import STATE, is_out_of_memory, limit_memory, namespace


def ensure_accelerator(options: CellOptions):
    """The Accelerator for ``options``, rebuilt when options or process group change."""
    if STATE.spec is None:
        raise RuntimeError("this engine has no process group; run %fleet start again")
    key = (options, STATE.spec.generation)
    if STATE.accelerator is None or STATE.accelerator_key != key or _accelerate_state_reset():
        from workbench.rank.strategies import build_accelerator

        _forget_sharding_plans(STATE.spec.generation)
        STATE.accelerator = build_accelerator(options, STATE.device.type, STATE.spec.nodes)
        STATE.accelerator_key = key
    return STATE.accelerator


_planned_in: list = [None]  # the process-group generation DTensor's sharding cache was filled in


def _forget_sharding_plans(generation: int) -> None:
    """In a new process group, clear DTensor's (per-thread) cache of sharding decisions: it
    compares device meshes by their shape and names, not by their process groups, so after a
    rebuild an in-place op (the optimizer step) would give a new model's parameters the mesh of
    the old group, whose groups are gone (``full_tensor()`` then fails)."""
    import sys

    if _planned_in[0] == generation or "torch.distributed.tensor" not in sys.modules:
        _planned_in[0] = generation
        return
    _planned_in[0] = generation
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # the Python cache and the C++ one

    _clear_sharding_prop_cache()


def names(options: CellOptions) -> dict:
    """The names every ``%%distributed`` cell sees."""
    accelerator = ensure_accelerator(options)
    return {
        "accelerator": accelerator,
        "rank": STATE.spec.rank,
        "world_size": STATE.spec.world_size,
        "local_rank": STATE.spec.local_rank,
        "device": STATE.device,
        "mesh": accelerator.workbench_mesh,  # hsdp / --tp / --pp, else None
        "workbench": sys.modules["workbench"],  # loaded: this module is part of it
    }


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


def _failure(exc: BaseException, skip_frames: int) -> CellReply:
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    exc.__traceback__ = tb = _user_frames(tb)
    if isinstance(exc, SystemExit):  # exit(n) / sys.exit(n): the rank ends its part as a script would
        where = "".join(traceback.format_list(traceback.extract_tb(tb)))  # where it exited, no exception line
        return CellReply(ok=False, ename="SystemExit", evalue=_exit_code(exc), traceback=where)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    evalue = str(exc)
    if _over_memory_limit(exc):
        note = (f"this rank's memory limit ({STATE.memory_limit / 2**30:.3g} GiB, --memory-limit) was reached; "
                "lower the batch or model size, or raise the limit")
        evalue, text = f"{evalue} [{note}]", f"{text.rstrip()}\nMemoryLimit: {note}\n"
    return CellReply(ok=False, ename=type(exc).__name__, evalue=evalue, traceback=text)


_MACHINERY = (runpy.__file__, "<frozen runpy>", batch_process.__file__)
_IPYTHON = f"{os.sep}IPython{os.sep}"


def _user_frames(tb):
    """``tb`` without the frames of the machinery between a cell and the user's code (IPython's
    ``%run``, runpy), so that a script's traceback reads as under ``python script.py``."""
    frames = []
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (filename.startswith(_MACHINERY) or _IPYTHON in filename):
            frames.append(tb)
        tb = tb.tb_next
    for before, after in zip(frames, frames[1:] + [None], strict=True):
        before.tb_next = after
    return frames[0] if frames else None


def _exit_code(exc: SystemExit) -> str:
    """A script's exit code as torchrun reports it (``sys.exit("message")`` exits with 1)."""
    code = exc.code
    return str(code if isinstance(code, int) else 0 if code is None else f"1 ({code})")


def succeeded(exc: BaseException) -> bool:
    """``sys.exit(0)`` / ``exit()``: the rank's part of the cell ended, without an error."""
    return isinstance(exc, SystemExit) and exc.code in (0, None)


def _over_memory_limit(exc: BaseException) -> bool:
    return STATE.memory_limit is not None and is_out_of_memory(exc)


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
    code: str, options: dict, cell_name: str, return_value: bool = False, display_value: bool = True,
    stop_on_nan: bool = False,
) -> CellReply:
    """Run a ``%%distributed`` cell on this rank.

    Returns the value and its display, or the failure with the traceback of the
    user's code only. ``stop_on_nan``: a NaN or infinite value logged ends the cell.
    """
    STATE.cells += 1
    ns = namespace()
    try:
        ns.update(names(CellOptions(**options)))
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel as this rank's error
        return _failure(exc, skip_frames=0)
    filename = f"<{cell_name}>"
    LOGGER.cell_started(stop_on_nan)
    try:
        body, last = _compile_cell(code, filename)
        with _UserCode():
            exec(body, ns)
            value = eval(last, ns) if last is not None else None
    except BaseException as exc:  # noqa: BLE001
        if succeeded(exc):
            return _with_metrics(CellReply(ok=True, value=None, display=None))
        return _with_metrics(_failure(exc, skip_frames=1))
    result = CellReply(ok=True, value=None, display=None)
    if value is not None:
        ns["_"] = value
        if return_value:
            result["value"] = to_cpu(value)
        if display_value:
            result["display"] = _format(value)
    return _with_metrics(result)


def run_function(fn, args: tuple, kwargs: dict, options: dict) -> CellReply:
    """Call ``fn(*args, **kwargs)`` on this rank, with the cell names defined."""
    ns = namespace()
    try:
        ns.update(names(CellOptions(**options)))
        LOGGER.cell_started()
        with _UserCode():
            value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        if succeeded(exc):
            return _with_metrics(CellReply(ok=True, value=None, display=None))
        return _with_metrics(_failure(exc, skip_frames=1))
    return _with_metrics(CellReply(ok=True, value=to_cpu(value), display=None))


def _with_metrics(reply: CellReply) -> CellReply:
    """Add how many metrics records this rank sent (the kernel waits for them), and
    errors of background checkpoint saves (reported once, never lost)."""
    import os

    from workbench.checkpoint.api import take_errors, wait_for_staging

    wait_for_staging()  # the next cell may change parameters in place
    LOGGER.cell_finished()
    reply["group_intact"] = STATE.group_intact()
    reply["metrics"] = MetricsMark(pid=os.getpid(), seq=LOGGER.flush(), cell=LOGGER.cells)
    errors = take_errors()  # every rank has the same failure (DCP is collective); rank 0 reports it once
    reply["notices"] = errors if STATE.spec is not None and STATE.spec.rank == 0 else []
    reply["notices"] += batch_process.take_notices()  # the same on every rank: the kernel shows it once
    reply["config"] = take_config()
    if LOGGER.send_error is not None:  # the sender survived it; say so once
        rank = STATE.spec.rank if STATE.spec is not None else "?"
        reply["notices"].append(f"rank {rank}: the metrics sender skipped a message ({LOGGER.send_error})")
        LOGGER.send_error = None
    return reply


def call(fn, args: tuple, kwargs: dict) -> CellReply:
    """Call a workbench function on this rank as the kernel's request (no cell names set)."""
    try:
        with _UserCode():
            value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        return _failure(exc, skip_frames=1)
    return CellReply(ok=True, value=to_cpu(value), display=None)


def warm() -> None:
    """A spare engine: import what a rank needs now, so that taking a rank is quick."""
    batch_process.text_progress_bars()  # before accelerate imports tqdm.auto
    import accelerate  # noqa: F401
    import torch._dynamo  # noqa: F401 - FSDP2 and accelerate's prepare import it at first use (0.4 s)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401



def attach(metrics_address: str, metrics_key: str, run_dir: str, checkpoint_dir: str, memory_limit: int | None = None,
           cpu: bool = True) -> None:
    """Join the fleet run: metrics go to the kernel's collector (signed with ``metrics_key``),
    checkpoints to ``checkpoint_dir``, and ``memory_limit`` bytes at most (:func:`limit_memory`)."""
    STATE.run_dir, STATE.checkpoint_dir = run_dir, checkpoint_dir
    batch_process.become_batch_process()
    stacks.enable(run_dir)
    LOGGER.attach(metrics_address, metrics_key)
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


def pull(name: str) -> CellReply:
    """The value of ``name`` in this rank's namespace, tensors moved to CPU."""
    ns = namespace()
    if name not in ns:
        return CellReply(ok=False, ename="NameError", evalue=f"name {name!r} is not defined on this rank",
                         traceback="")
    return CellReply(ok=True, value=to_cpu(ns[name]), display=None)


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


def user_names() -> list[str]:
    """The names in this rank's namespace that cells made (not IPython's own)."""
    from IPython import get_ipython

    shell = get_ipython()
    hidden = getattr(shell, "user_ns_hidden", {}) if shell is not None else {}
    return sorted(name for name in namespace() if name not in hidden and not name.startswith("_"))


def push(values: dict) -> None:
    """Set ``values`` in this rank's namespace."""
    namespace().update(values)
