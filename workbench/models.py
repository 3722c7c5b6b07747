"""Small example models, built in code (no downloads), ready for every strategy.

``TinyTransformer`` has a ``tp_plan`` for ``--tp`` and its layers in an
``nn.ModuleList`` (the blocks that hsdp shards and
``--activation-checkpointing`` wraps). Its attention takes the number of heads
from the width of its (possibly tensor-parallel) projections, so the same code
runs whole or split over ranks.
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(nn.functional.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, heads), FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# Megatron-style: q/k/v and the first MLP layer split by output (heads), o and the
# second MLP layer by input; one all-reduce after attention and one after the MLP.
BLOCK_TP_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
                 "mlp.w1": "colwise", "mlp.w2": "rowwise"}


class TinyTransformer(nn.Module):
    """A causal transformer over float inputs ``(batch, length, dim)`` → ``(batch, length, dim)``."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, hidden: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, hidden or 4 * dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.tp_plan = {f"layers.{i}.{name}": style for i in range(layers) for name, style in BLOCK_TP_PLAN.items()}

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def mlp(width: int = 32, hidden: int = 128, depth: int = 2) -> nn.Sequential:
    """``Linear → ReLU → Linear`` ``depth`` times: pairs for ``--tp``, stages for ``--pp``."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def synthetic_batch(step: int, batch: int, width: int, length: int | None = None, seed: int = 0):
    """The same ``(inputs, targets)`` on every rank that asks for the same step (for TP/PP)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    shape = (batch, length, width) if length else (batch, width)
    inputs = torch.randn(*shape, generator=generator)
    return inputs, torch.tanh(inputs.flip(-1))
