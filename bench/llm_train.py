"""A small Hugging Face training script (Llama architecture, random init, tokenizer and data
built in code), written as a user would for ``torchrun``/``accelerate launch``: it builds its own
``Accelerator``. bench_llm.py runs it under torchrun and on a fleet, the test suite runs its
``transformers.Trainer`` variant both ways.

``torchrun --nproc-per-node 2 bench/llm_train.py [loop|trainer] STEPS OUT.json``
"""

from __future__ import annotations

import json
import random
import sys
import time

SEQ = 64
WORDS = ["the", "fleet", "trains", "a", "model", "on", "every", "rank", "while", "notebook", "cells", "run",
         "fast", "gradients", "flow", "through", "shards", "and", "checkpoints", "save", "state"]


def build(seed: int = 0):
    """Tokenizer (BPE trained on generated text), an in-memory dataset and a small Llama."""
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(seed)
    text = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<eos>"],
                                                            show_progress=False))
    eos = tokenizer.token_to_id("<eos>")
    ids = [t for line in text for t in tokenizer.encode(line).ids + [eos]]
    chunks = [ids[i:i + SEQ] for i in range(0, len(ids) - SEQ, SEQ)]
    dataset = Dataset.from_dict({"input_ids": chunks, "labels": chunks}).with_format("torch")
    transformers.set_seed(seed)
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=128, intermediate_size=344,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    return tokenizer, dataset, LlamaForCausalLM(config)


def train_loop(steps: int) -> dict:
    """An accelerate training loop; returns per-step losses and times, and tokens/s."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    _tokenizer, dataset, model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, times, tokens = [], [], 0
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        start = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        tokens += batch["input_ids"].numel()
    accelerator.wait_for_everyone()
    return {"rank": accelerator.process_index, "losses": losses, "step_times": times,
            "tokens_per_s": tokens / sum(times)}


def train_trainer(steps: int, output_dir: str) -> dict:
    """The same model and data through ``transformers.Trainer``, unchanged."""
    from transformers import Trainer, TrainingArguments

    _tokenizer, dataset, model = build()
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, max_steps=steps,
                             learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                             disable_tqdm=True, seed=0, use_cpu=not __import__("torch").cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"rank": trainer.args.process_index, "global_step": result.global_step, "losses": losses,
            "world_size": trainer.args.world_size}


if __name__ == "__main__":
    mode, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = train_loop(steps) if mode == "loop" else train_trainer(steps, out + ".trainer")
    if result["rank"] == 0:
        with open(out, "w") as f:
            json.dump(result, f)
