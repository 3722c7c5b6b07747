"""``--comm-hook``: torch's own DDP communication hooks (no hand-written compression)."""

from __future__ import annotations

from workbench.parallel.options import parse_comm_hook


def comm_hook(spec: str | None):
    """``(state, hook)`` to register on a DDP model for ``--comm-hook spec`` (None: plain all-reduce).

    bf16: torch refuses ``bf16_compress_hook`` at registration by a name-based
    CUDA/NCCL check, although gloo all-reduces bf16 fine; workbench registers it
    inside its timing wrapper (another name), which passes the check.
    PowerSGD starts compressing at the second step (torch's minimum with error
    feedback); tensors that would not compress 2x are all-reduced as they are.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if spec is None:
        return None, default_hooks.allreduce_hook
    name, rank = parse_comm_hook(spec)
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    return state, powerSGD_hook.powerSGD_hook
