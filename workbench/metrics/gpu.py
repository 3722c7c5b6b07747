"""Engine side: this rank's GPU utilisation and memory as NVML reports them (the numbers
nvidia-smi shows), when nvidia-ml-py is installed and the rank is on a CUDA device.

Read through torch's own NVML helpers (``torch.cuda.utilization``,
``torch.cuda.device_memory_used``), which map this process's device to the NVML index
through ``CUDA_VISIBLE_DEVICES``. Sampled at most once a second; the first NVML error
turns the probe off for the process (no NVML library, a driver without it).
"""

from __future__ import annotations

import time

SAMPLE_EVERY_S = 1.0


class GpuProbe:
    def __init__(self) -> None:
        self.off = False
        self._at = float("-inf")
        self._values: dict = {}

    def sample(self, cuda) -> dict:
        """``{"gpu_util_pct", "gpu_mem_used_mb"}`` of ``cuda``'s current device (``torch.cuda``)."""
        if self.off:
            return {}
        now = time.monotonic()
        if now - self._at < SAMPLE_EVERY_S:
            return self._values
        self._at = now
        try:
            device = cuda.current_device()
            values = {"gpu_util_pct": float(cuda.utilization(device))}
            if hasattr(cuda, "device_memory_used"):  # torch >= 2.6
                values["gpu_mem_used_mb"] = cuda.device_memory_used(device) / 2**20
        except Exception:  # ModuleNotFoundError without nvidia-ml-py, NVMLError, ...
            self.off, values = True, {}
        self._values = values
        return values
