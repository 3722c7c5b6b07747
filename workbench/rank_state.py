"""Engine side, the bottom layer: this engine's place in the fleet (:data:`STATE`).

Everything else on the engine side reads it from here: the cell runner
(:mod:`workbench.rank.engine`), rendezvous, metrics and checkpoints. It imports nothing of workbench.
"""

from __future__ import annotations

import sys
import weakref


class RankState:
    """This engine's place in the fleet, the Accelerator of the last cell (built by
    :func:`workbench.rank.engine.ensure_accelerator`), and the rank's other process-wide state,
    each field written by the one module named beside it.

    Two more objects live as long as the rank and have one owner each: the step counter and
    record sender ``workbench.metrics.logger.LOGGER``, and the background saves
    ``workbench.checkpoint.api.SAVES``."""

    def __init__(self) -> None:
        self.spec = None
        self.device = None
        self.accelerator = None
        self.accelerator_key = None
        self.pg_sockets: set = set()  # (local, remote) addresses of the group's connections
        self.group = None  # the default process group workbench made (user code may destroy or replace it)
        self.cells = 0
        self.run_dir: str | None = None  # the fleet run's folder
        self.checkpoint_dir: str | None = None  # where checkpoints go: a folder or an fsspec URL
        self.in_user_code = False
        self.memory_limit: int | None = None  # bytes (--memory-limit)
        # workbench.checkpoint.replica: this rank's state dict set aside by keep() until share() or
        # drop(), and which shards it holds
        self.kept_state: dict | None = None
        self.kept_holds: list | None = None
        self.writer = None  # workbench.checkpoint.writer: the helper process that writes async saves
        self.stack_file = None  # workbench.rank.stacks: the stack file, kept open for faulthandler
        # workbench.data_position: positions advance at optimizer steps (an optimizer was
        # prepared), not at each batch; the positions of the prepared dataloaders
        self.positions_at_steps = False
        self.positions: weakref.WeakSet = weakref.WeakSet()
        self.joined_notice_sent = False  # workbench.rank.batch_process: said once that a script's group is ours
        self.bf16_warned = False  # workbench.rank.strategies: said once that bf16 is emulated on this CPU

    @property
    def world_size(self) -> int:
        """Ranks in the fleet's process group (1 outside a fleet)."""
        return self.spec.world_size if self.spec else 1

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


STATE = RankState()


def namespace() -> dict:
    """The engine's IPython namespace (``__main__``'s outside IPython: a script's ranks)."""
    from IPython import get_ipython

    shell = get_ipython()
    return shell.user_ns if shell is not None else sys.modules["__main__"].__dict__


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


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: CUDA's OutOfMemoryError, MemoryError, or
    torch's CPU allocator refusing (``--memory-limit``'s address-space limit)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(parent_pid: int) -> None:
    """In a child of this rank (its checkpoint writer, a DataLoader worker): be killed when the
    rank dies, so that nothing it inherited (the process group's sockets) outlives it."""
    import ctypes
    import os
    import signal

    if sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the rank died before the line above
        os._exit(0)
