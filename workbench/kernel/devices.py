"""Which GPUs this machine has, and which engine gets which one.

Runs in the kernel, so it never imports torch (that costs seconds): GPUs are
read from ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import psutil

from workbench.errors import OptionsError
from workbench.kernel.notices import notice

DEFAULT_CPU_ENGINES = 2


def visible_gpus() -> list[str]:
    """GPU ids this process may use, in order (``CUDA_VISIBLE_DEVICES`` wins)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


@dataclass(frozen=True)
class EngineSlot:
    """One engine to start: its slot number (rank order), GPU and host, if chosen here."""

    slot: int
    gpu: str | None = None
    host: str | None = None  # --hosts: the host its engine starts on

    @property
    def device_type(self) -> str:
        return "cpu" if self.gpu is None else "cuda"


def parse_gpu_list(text: str) -> list[str]:
    """Parse ``--gpus 0,2`` into ``["0", "2"]``."""
    gpus = [g.strip() for g in str(text).split(",") if g.strip()]
    if not gpus:
        raise OptionsError("--gpus needs a comma-separated list of GPU ids, e.g. --gpus 0,1")
    if len(set(gpus)) != len(gpus):
        raise OptionsError(f"--gpus {text} names a GPU twice; give each GPU once, e.g. --gpus 0,1")
    return gpus


def plan_engines(
    n: int | None = None,
    gpus: list[str] | None = None,
    *,
    cpu: bool = False,
    visible: list[str] | None = None,
    first_slot: int = 0,
) -> list[EngineSlot]:
    """Decide how many engines to start and which GPU each one sees.

    - ``gpus`` given: one engine per listed GPU (``n``, if given, must match).
    - GPUs visible and not ``cpu``: ``n`` engines on the first ``n`` GPUs
      (default: one per visible GPU).
    - otherwise ``n`` CPU engines (default 2).
    """
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise OptionsError(f"-n must be a whole number of engines, not {n!r}; e.g. -n 2")
        if n < 1:
            raise OptionsError(f"-n must be at least 1 (got {n}); e.g. %fleet start -n 2")
    visible = visible_gpus() if visible is None else visible
    if gpus is not None:
        if cpu:
            raise OptionsError("--gpus and --cpu contradict each other; pass one of them")
        missing = [g for g in gpus if g not in visible]
        if missing:
            have = ",".join(visible) if visible else "none"
            raise OptionsError(
                f"GPU {','.join(missing)} is not visible on this machine (visible GPUs: {have}); "
                "pick from those, or start CPU engines with -n N --cpu"
            )
        if n is not None and n != len(gpus):
            raise OptionsError(f"-n {n} does not match --gpus {','.join(gpus)} ({len(gpus)} GPUs); drop -n")
        return [EngineSlot(first_slot + i, g) for i, g in enumerate(gpus)]
    if visible and not cpu:
        if n is not None and n > len(visible):
            raise OptionsError(
                f"asked for {n} engines but only {len(visible)} GPUs are visible; "
                f"use -n {len(visible)} or fewer, or --cpu for CPU engines"
            )
        count = len(visible) if n is None else n
        return [EngineSlot(first_slot + i, visible[i]) for i in range(count)]
    count = DEFAULT_CPU_ENGINES if n is None else n
    return [EngineSlot(first_slot + i) for i in range(count)]


ENGINE_MEMORY_BYTES = 500 * 2**20  # an idle CPU engine with torch and accelerate imported (measured ~450 MiB)
CPU_ENGINES_PER_CORE = 4  # past this, gloo collectives and heartbeats starve


def check_machine_fits(n: int) -> None:
    """Refuse a local CPU fleet this machine cannot hold (memory), warn about one it cannot run well."""
    available = psutil.virtual_memory().available
    cores = os.cpu_count() or 1
    if n * ENGINE_MEMORY_BYTES > available:
        raise OptionsError(f"{n} CPU engines need about {n * ENGINE_MEMORY_BYTES / 2**30:.0f} GiB but this machine has "
                           f"{available / 2**30:.0f} GiB available; use at most -n {max(1, available // ENGINE_MEMORY_BYTES)}")
    if n > CPU_ENGINES_PER_CORE * cores:
        notice(f"{n} CPU engines on {cores} cores will be slow and may time out in collectives; "
               f"consider -n {cores}")


