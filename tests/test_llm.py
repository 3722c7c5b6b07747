"""The Hugging Face LLM path: transformers.Trainer unchanged on the fleet gives torchrun's
losses; tokens/s and MFU in the metrics."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).parent.parent / "bench"
IMPORT = f"import sys; sys.path.insert(0, {str(BENCH)!r})\n"
STEPS = 6


def test_trainer_unchanged_on_the_fleet_matches_torchrun(fleet, tmp_path):
    out = tmp_path / "torchrun.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(BENCH / "llm_train.py"), "trainer", str(STEPS), str(out)],
                   check=True, timeout=300, capture_output=True, cwd=tmp_path,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    reference = json.loads(out.read_text())
    got = fleet.run(IMPORT + f"from llm_train import train_trainer\ntrain_trainer({STEPS}, {str(tmp_path / 'f')!r})",
                    strategy="none", show_output=False)
    assert got[0]["global_step"] == reference["global_step"] == STEPS
    assert got[0]["world_size"] == reference["world_size"] == 2
    assert got[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert reference["losses"][-1] < reference["losses"][0]


def test_flops_per_token_follows_the_palm_count():
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.llm import flops_per_token, parameter_count

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert parameter_count(model) == n
    assert flops_per_token(model, 16) == 6 * n + 12 * 2 * 4 * 8 * 16


def test_tokens_after_the_optimizer_step_become_tokens_per_s_and_mfu(fleet):
    start = len(fleet.metrics.store)
    fleet.run(
        "import torch\nm = torch.nn.Linear(64, 64)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "m, opt = accelerator.prepare(m, opt)\ninfo = workbench.llm.track_mfu(m, seq_len=16)\n"
        "for _ in range(5):\n    m(torch.randn(16, 64)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "    workbench.log(loss=1.0, tokens=16)\n",  # logged after optimizer.step(), as the README shows
        strategy="ddp", show_output=False)
    records = [r for r in fleet.metrics.store.since(start) if "loss" in r.scalars]
    assert len(records) == 10
    for r in records:
        assert r.system["tokens_per_s"] == pytest.approx(16 / r.system["step_time_s"])
        assert 0 < r.system["mfu"] < 1
