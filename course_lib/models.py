"""Small models the lessons and tests shard, with sizes chosen to show what sharding does.

`ToyModel` has odd sizes on purpose (13, 5): split over 2 or 4 ranks they do
not divide evenly, so FSDP's padding is visible. Everything is built on CPU
from a seed, so every rank (and the single-process reference) gets the same
initial weights without any download.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "ToyModel", "toy_batch", "toy_model"]


class Block(nn.Module):
    """Linear(dim, hidden) -> ReLU -> Linear(hidden, dim), with a residual: a transformer MLP in miniature."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ToyModel(nn.Module):
    """`layers` Blocks then a Linear head: (batch, dim) -> (batch, out)."""

    def __init__(self, dim: int = 8, hidden: int = 13, layers: int = 2, out: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy_model(*, dim: int = 8, hidden: int = 13, layers: int = 2, out: int = 5, seed: int = 0) -> ToyModel:
    """A `ToyModel` with weights drawn from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    return ToyModel(dim=dim, hidden=hidden, layers=layers, out=out)


def toy_batch(batch: int = 4, *, dim: int = 8, out: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic (inputs, targets) pair for `ToyModel`, drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=generator), torch.randn(batch, out, generator=generator)
