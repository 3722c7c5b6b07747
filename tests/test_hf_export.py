"""A checkpoint's model as a Hugging Face folder (issue 39, item 2): trained with per-block FSDP2
on 2 ranks, exported, and loaded with ``from_pretrained`` in a plain CPU process: the same logits."""

from __future__ import annotations

import json
import os

import pytest

from workbench import CheckpointError

LLAMA = """
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
transformers.set_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
llm = LlamaForCausalLM(config)
llm_optimizer = torch.optim.AdamW(llm.parameters(), lr=1e-2)
llm, llm_optimizer = accelerator.prepare(llm, llm_optimizer)
ids = torch.arange(24).reshape(2, 12) % 96
for _ in range(3):
    loss = llm(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    llm_optimizer.step(); llm_optimizer.zero_grad()
"""


def test_an_fsdp_llama_exports_and_from_pretrained_gives_the_fleets_logits(fleet, tmp_path):
    from transformers import LlamaForCausalLM

    fleet.run(LLAMA, strategy="fsdp", show_output=False)
    tag = fleet.checkpoints.save(tag="hf-export")
    want = fleet.run("llm.eval()\nwith torch.no_grad():\n    out = llm(input_ids=ids).logits\nout", strategy="fsdp",
                     show_output=False)[0]
    out = tmp_path / "hf"
    files = fleet.checkpoints.export(tag, str(out), model="llm")
    assert "config.json" in files and "model.safetensors" in files
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 32
    model = LlamaForCausalLM.from_pretrained(str(out))
    import torch

    with torch.no_grad():
        got = model(input_ids=torch.arange(24).reshape(2, 12) % 96).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    with pytest.raises(CheckpointError, match="is not empty; export into a new folder"):
        fleet.checkpoints.export(tag, str(out), model="llm")
    with pytest.raises(CheckpointError, match="no model named 'nothing'"):
        fleet.checkpoints.export(tag, str(tmp_path / "none"), model="nothing")
    assert not os.path.exists(tmp_path / "none") or not os.listdir(tmp_path / "none")
