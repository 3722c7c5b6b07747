"""One prepared check of the GPU paths, a few minutes on the smallest GPU box (one GPU):
``python bench/gpu_check.py``. Prints one line per check and a JSON summary; exits 1 if any failed.

1. a 1-rank fleet on the GPU: nccl, cuda:0, accelerate's distributed type;
2. bf16 and fp16 (accelerate's GradScaler) training steps with DDP;
3. per-block FSDP2 on CUDA: unit count and ``max_memory_allocated`` during a forward;
4. CUDA memory in the metrics (``cuda_max_mb``; NVML's utilisation and memory with nvidia-ml-py);
5. ``--memory-limit`` as a fraction of the GPU's memory: an allocation past it fails on the rank;
6. a checkpoint round trip (save, change the weights, restore, compare);
7. the LLM notebook's model (bench/llm_train.py) for 50 steps: tokens/s and MFU.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
import traceback

from workbench import CellOptions, Fleet

HERE = pathlib.Path(__file__).parent
IMPORT = f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
RESULTS: dict[str, object] = {}

TRAIN = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                              torch.nn.Linear(4096, 1024)) for _ in range(8)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(64, 1024, device=device)
for _ in range(5):
    with accelerator.autocast():
        loss = model(x).float().pow(2).mean()
    accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    workbench.log(loss=loss.item())
(str(accelerator.distributed_type), accelerator.mixed_precision, type(accelerator.scaler).__name__, loss.item())
"""


def check(name):
    def wrap(fn):
        def run(*args):
            start = time.perf_counter()
            try:
                RESULTS[name] = fn(*args)
                print(f"ok    {name} ({time.perf_counter() - start:.1f} s): {RESULTS[name]}", flush=True)
            except Exception as exc:  # noqa: BLE001 - every check reports, the next one runs
                RESULTS[name] = f"FAILED: {type(exc).__name__}: {exc}"
                print(f"FAIL  {name}: {exc}\n{traceback.format_exc()}", flush=True)
        return run
    return wrap


@check("fleet")
def fleet_info(fleet):
    return fleet.run("import torch, torch.distributed as dist\n"
                     "(dist.get_backend(), str(device), torch.cuda.get_device_name(0), str(accelerator.distributed_type))")


@check("bf16")
def bf16(fleet):
    return fleet.run(TRAIN, mixed_precision="bf16", show_output=False)


@check("fp16")
def fp16(fleet):
    return fleet.run(TRAIN, mixed_precision="fp16", show_output=False)


@check("fsdp_per_block")
def fsdp(fleet):
    code = TRAIN.split("x = torch")[0] + (
        "from workbench.parallel import fsdp_unit_count\ntorch.cuda.reset_peak_memory_stats()\n"
        "base = torch.cuda.memory_allocated()\nmodel(torch.randn(64, 1024, device=device)).sum().backward()\n"
        "(fsdp_unit_count(model), (torch.cuda.max_memory_allocated() - base) / 2**20)")
    return {wrap: fleet.run(code, options=CellOptions(strategy="fsdp", mixed_precision="bf16", fsdp_wrap=wrap), show_output=False)[0]
            for wrap in ("auto", "none")}


@check("cuda_memory_in_metrics")
def cuda_metrics(fleet):
    fleet.run(TRAIN, show_output=False)
    records = fleet.metrics.store.since(0)
    return {"cuda_max_mb": max(r.system.get("cuda_max_mb", 0) for r in records),
            # NVML (nvidia-ml-py installed): None here means the probe found no NVML
            "gpu_util_pct": max((r.system["gpu_util_pct"] for r in records if "gpu_util_pct" in r.system), default=None),
            "gpu_mem_used_mb": max((r.system["gpu_mem_used_mb"] for r in records if "gpu_mem_used_mb" in r.system),
                                   default=None)}


@check("checkpoint_round_trip")
def checkpoint(fleet):
    fleet.run(TRAIN, strategy="fsdp", show_output=False)
    fleet.checkpoints.save(tag="gpu-check")
    before = fleet.run("float(sum(p.full_tensor().float().sum() for p in model.parameters()))", strategy="fsdp")
    fleet.run("import torch\nwith torch.no_grad():\n    [p.zero_() for p in model.parameters()]", strategy="fsdp")
    fleet.checkpoints.restore("gpu-check")
    after = fleet.run("float(sum(p.full_tensor().float().sum() for p in model.parameters()))", strategy="fsdp")
    assert before == after, (before, after)
    return before


@check("llm_50_steps")
def llm(fleet):
    code = IMPORT + (
        "import torch, time\nfrom llm_train import build, SEQ\n_t, data, model = build()\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=3e-3)\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)\n"
        "model, opt, loader = accelerator.prepare(model, opt, loader)\ninfo = workbench.llm.track_mfu(model, SEQ)\n"
        "it = iter(loader)\nfor step in range(50):\n    batch = next(it)\n"
        "    loss = model(input_ids=batch['input_ids'], labels=batch['labels']).loss\n"
        "    accelerator.backward(loss); opt.step(); opt.zero_grad()\n"
        "    workbench.log(loss=loss.item(), tokens=batch['input_ids'].numel())\nloss.item()")
    start = len(fleet.metrics.store)
    loss = fleet.run(code, options=CellOptions(strategy="fsdp", mixed_precision="bf16"), show_output=False)[0]
    recs = [r for r in fleet.metrics.store.since(start) if "tokens_per_s" in r.system][10:]
    return {"loss": loss, "tokens_per_s": sum(r.system["tokens_per_s"] for r in recs) / len(recs),
            "mfu": sum(r.system["mfu"] for r in recs) / len(recs)}


def memory_limit():
    @check("memory_limit_fraction")
    def run():
        with Fleet(n=1, progress=False, wandb=False, memory_limit="4G") as fleet:
            try:
                fleet.run("import torch\ntorch.empty(6 * 2**30, dtype=torch.uint8, device=device)", show_output=False)
            except Exception as exc:  # noqa: BLE001
                assert "memory limit" in str(exc) or "out of memory" in str(exc).lower(), exc
                return f"refused: {str(exc)[:120]}"
            raise AssertionError("a 6 GiB allocation passed a 4G --memory-limit")
    run()


def main() -> int:
    with Fleet(n=1, progress=False, wandb=False) as fleet:
        for step in (fleet_info, bf16, fp16, fsdp, cuda_metrics, checkpoint, llm):
            step(fleet)
    memory_limit()
    print(json.dumps(RESULTS, indent=1, default=str))
    return int(any(isinstance(v, str) and v.startswith("FAILED") for v in RESULTS.values()))


if __name__ == "__main__":
    sys.exit(main())
