"""Small models the lessons and tests shard, with sizes chosen to show what sharding does.

`ToyModel` has odd sizes on purpose (13, 5): split over 2 or 4 ranks they do
not divide evenly, so FSDP's padding is visible. Everything is built on CPU
from a seed, so every rank (and the single-process reference) gets the same
initial weights without any download.
"""

from __future__ import annotations

import torch
from torch import nn

from .llama_config import LLAMA_CONFIG

__all__ = ["LLAMA_CONFIG", "Block", "TinyLM", "ToyModel", "make_batch", "make_batches", "make_llama", "make_mlp",
           "make_model", "make_tokens", "rank_batch", "shard_model", "toy_batch", "toy_model"]


class Block(nn.Module):
    """Linear(dim, hidden) -> ReLU -> Linear(hidden, dim), with a residual: a transformer MLP in miniature."""

    def __init__(self, dim: int = 16, hidden: int = 32):
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


class TinyLM(nn.Module):
    """Lesson 06's language model for sequence parallelism: Embedding(vocab, hidden) -> RMSNorm -> MLP
    (Linear(hidden, 4 hidden) -> GELU -> Linear(4 hidden, hidden), added to its input) -> RMSNorm ->
    Linear(hidden, vocab, bias=False), the logits. Submodules: embed, norm, mlp.0, mlp.2, out_norm, head."""

    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, hidden), nn.RMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.out_norm, self.head = nn.RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.mlp(self.norm(x))
        return self.head(self.out_norm(x))


def toy_model(*, dim: int = 8, hidden: int = 13, layers: int = 2, out: int = 5, seed: int = 0) -> ToyModel:
    """A `ToyModel` with weights drawn from `seed` (the same on every rank)."""
    torch.manual_seed(seed)
    return ToyModel(dim=dim, hidden=hidden, layers=layers, out=out)


def toy_batch(batch: int = 4, *, dim: int = 8, out: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic (inputs, targets) pair for `ToyModel`, drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=generator), torch.randn(batch, out, generator=generator)


# --- the lessons' models: one definition each, imported by every %%torchrun cell ----------------------
# `print(inspect.getsource(make_model))` in a cell shows the code; every function seeds itself, so the
# single-process reference and each rank build the same weights.


def make_mlp(batch_norm: bool = False) -> nn.Sequential:
    """Lesson 03's model: Linear(8, 16) -> ReLU -> Linear(16, 4), weights from seed 0. `batch_norm=True`
    adds BatchNorm1d(16) after the first Linear: the same weights, plus 3 buffers (mean, variance, count)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if batch_norm else []
    return nn.Sequential(nn.Linear(8, 16), *norm, nn.ReLU(), nn.Linear(16, 4))


def make_batches(rank: int, count: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Lesson 03's data: rank `rank`'s first `count` (inputs, targets) batches, the same in every process that asks."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(size, 8, generator=generator), torch.randn(size, 4, generator=generator))
            for _ in range(count)]


def make_model() -> nn.Sequential:
    """Lessons 04-05's model: Linear(8, 16), two residual `Block(16, 32)`s, Linear(16, 4); weights from seed 0.

    The Blocks are the units FSDP wraps (a transformer layer, in small); names are `0.weight`,
    `1.up.weight`, ..., `3.bias`.
    """
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(16, 32), Block(16, 32), nn.Linear(16, 4))


def make_batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Lessons 04-05's data: `n` (inputs, targets) rows from seed 1; ranks take their rows of it."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=generator), torch.randn(n, 4, generator=generator)


def rank_batch(rank: int, world_size: int, n: int = 8, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of `make_batch(n)`: n / world_size consecutive rows each, on `device`.

    The ranks' slices, in rank order, are the whole batch, so N ranks together see what one process sees.
    """
    if n % world_size:
        raise ValueError(f"rank_batch: {n} rows do not split evenly over {world_size} ranks")
    rows = slice(rank * n // world_size, (rank + 1) * n // world_size)
    inputs, targets = make_batch(n)
    return inputs[rows].to(device), targets[rows].to(device)


def shard_model(model: nn.Sequential, mesh, **options) -> nn.Sequential:
    """Lesson 05's bottom-up `fully_shard` of `make_model()`: each Block (model[1], model[2]) becomes a unit,
    then the root, which takes what is left (the first and last Linear). `options` go to every call
    (`reshard_after_forward`, `mp_policy`, `offload_policy`, ...). Defined in lesson 05, section 3."""
    from torch.distributed.fsdp import fully_shard   # imported here: a rank's first FSDP import is slow

    for block in (model[1], model[2]):
        fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


# --- a tiny transformers Llama (lessons 06-07, launch/train.py): built from a config, no download ----------
# 4 attention heads and 2 KV heads (grouped-query attention), so tensor parallelism over 2 ranks divides both.

# LLAMA_CONFIG (course_lib/llama_config.py: importable without torch, for launch/train.py's flag checks)


def make_llama(seed: int = 0, **overrides):
    """A `LlamaForCausalLM` from `LLAMA_CONFIG` (plus `overrides`), random weights from `seed`, on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM  # imported here: transformers is slow to import

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, **overrides}))


def make_tokens(batch: int = 8, seq: int = 16, *, seed: int = 3, vocab_size: int = LLAMA_CONFIG["vocab_size"]) -> torch.Tensor:
    """Synthetic token ids (batch, seq) from `seed`, the same in every process that asks."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
