"""Engine side: model FLOPs utilisation (MFU) of language-model training.

``workbench.llm.track_mfu(model, seq_len)`` once after building the model; from then on every
``workbench.log(tokens=...)`` adds ``tokens_per_s`` and ``mfu`` to the rank's metrics.

FLOPs per token follow the PaLM appendix (as nanoGPT and torchtitan count them): ``6·N`` for
the matrix multiplies of forward and backward over the ``N`` parameters, plus
``12·layers·heads·head_dim·seq_len`` for attention (``6·layers·heads·head_dim·seq_len`` with
causal masking is not subtracted, as usual). The device's peak comes from a table of dense
bf16 tensor-core rates for GPUs, and on CPU from one measured matrix multiply (this rank's
threads, fp32), taken once per process.
"""

from __future__ import annotations

import functools
import time

# dense bf16 FLOP/s from the vendors' data sheets (no sparsity), matched on the device name
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}



def parameter_count(model) -> int:
    """Parameters of the whole model (a sharded DTensor counts its global size); tied weights once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: ``6·N`` plus attention, from the model's config (Hugging Face
    names: num_hidden_layers, num_attention_heads, hidden_size; nanoGPT's n_layer, n_head, n_embd)."""
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "module"):  # DDP
        config = getattr(model.module, "config", None)

    def field(*names):
        for name in names:
            value = getattr(config, name, None)
            if value is not None:
                return int(value)
        return 0

    layers = field("num_hidden_layers", "n_layer")
    heads = field("num_attention_heads", "n_head")
    width = field("hidden_size", "n_embd")
    head_dim = field("head_dim") or (width // heads if heads else 0)
    return 6.0 * parameter_count(model) + 12.0 * layers * heads * head_dim * seq_len


def peak_flops(device) -> float:
    """The device's peak FLOP/s: the table for a GPU (bf16 dense), a measurement on CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS.items():
            if key in name:
                return value
        raise ValueError(f"no peak FLOP/s known for {name!r}; pass peak= to track_mfu")
    return measured_cpu_flops()


@functools.cache
def measured_cpu_flops(size: int = 512, repeats: int = 8) -> float:
    """FLOP/s of an fp32 matrix multiply with this process's torch threads (measured once)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def track_mfu(model, seq_len: int, device=None, peak: float | None = None) -> dict:
    """From now on, ``workbench.log(tokens=...)`` adds ``mfu`` (and ``tokens_per_s``) to this
    rank's metrics. Returns what it uses: flops_per_token, peak_flops, parameters."""
    from workbench.metrics.logger import LOGGER

    if device is None:
        device = next(model.parameters()).device
    LOGGER.flops_per_token = flops_per_token(model, seq_len)
    LOGGER.peak_flops = peak or peak_flops(device)
    return {"flops_per_token": LOGGER.flops_per_token, "peak_flops": LOGGER.peak_flops,
            "parameters": parameter_count(model)}
