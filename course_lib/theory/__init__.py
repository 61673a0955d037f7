"""The numbers the lessons predict before they measure: memory, sharding layouts, model sizes.

Pure arithmetic, no process group: every function here says what a real run
*should* show (bytes per rank, which elements of which parameter a rank holds),
so tests and graders compare a run's ledger and shards against these numbers
instead of hard-coded ones. Units are bytes; exact counts are `int`.

Communication formulas (ring collectives, DDP/FSDP2 step collectives, tensor
parallelism) live in `theory.comm` and are re-exported here, so one import
serves: `from course_lib import theory`.

Sources: ZeRO (Rajbhandari et al. 2019, arXiv:1910.02054) for bytes per
parameter and the stages; torch 2.13's FSDP source for the layouts
(`torch/distributed/fsdp/_flat_param.py`, `_fully_shard/_fsdp_param.py`).
Optimizer and precision names, and the FSDP op names, are `course_lib.vocabulary`'s.
"""

from __future__ import annotations

import dataclasses
import math

from ..vocabulary import DEFAULT_PRECISION, LOW_PRECISION_DTYPES, OPTIMIZER_STATES, PRECISIONS
from .comm import (
    ddp_step_bytes,
    fsdp2_step_collectives,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_all_reduce_schedule,
    ring_reduce_scatter_bytes,
    ring_time_s,
    tp_layer_comm,
    zero_step_sent_bytes,
)

__all__ = [
    "BytesPerParam", "FlatShard", "MemoryPerRank",
    "bytes_per_param", "chunk_sizes", "fsdp1_flat_shards", "fsdp2_local_shape", "fsdp2_padded_shard_numel",
    "llama_param_count", "zero_memory_per_rank",
    # from theory.comm
    "ddp_step_bytes", "fsdp2_step_collectives",
    "ring_all_gather_bytes", "ring_all_reduce_bytes", "ring_all_reduce_schedule", "ring_reduce_scatter_bytes",
    "ring_time_s", "tp_layer_comm", "zero_step_sent_bytes",
]

# ---------------------------------------------------------------- memory (ZeRO)

@dataclasses.dataclass(frozen=True)
class BytesPerParam:
    """Bytes of model state per parameter: the weights, their gradients, the optimizer's state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def bytes_per_param(*, precision: str = DEFAULT_PRECISION, optimizer: str = "adam") -> BytesPerParam:
    """ZeRO's accounting (arXiv:1910.02054, section 3.1): mixed-precision Adam is 2 + 2 + 12 = 16 bytes.

    "fp32": 4-byte weights and gradients, optimizer states in fp32.
    "bf16-mixed"/"fp16-mixed": 2-byte weights and gradients used by forward and
    backward, and the optimizer also keeps an fp32 master copy of the weights
    (4 bytes) next to its states: Adam 4 + 4 + 4 = 12 ("K = 12" in the paper).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, not {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, not {precision!r}")
    states = 4 * OPTIMIZER_STATES[optimizer]  # each state tensor is fp32
    if precision in LOW_PRECISION_DTYPES:
        return BytesPerParam(2, 2, 4 + states)  # + the fp32 master weights
    return BytesPerParam(4, 4, states)


@dataclasses.dataclass(frozen=True)
class MemoryPerRank:
    """Bytes of model state one rank holds (no activations, no padding, no buffers)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_memory_per_rank(num_params: int, world_size: int, *, stage: int,
                         precision: str = DEFAULT_PRECISION, optimizer: str = "adam") -> MemoryPerRank:
    """Model-state memory per rank under ZeRO stage 0-3 (arXiv:1910.02054, Figure 1).

    Stage 0 is plain data parallelism (DDP: everything replicated); stage 1
    shards the optimizer states, stage 2 also the gradients (FSDP
    SHARD_GRAD_OP), stage 3 also the weights (FSDP FULL_SHARD, FSDP2). Each
    sharded part is divided by `world_size` exactly, ignoring FSDP's padding.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")
    per = bytes_per_param(precision=precision, optimizer=optimizer)
    n = num_params

    def part(bytes_each: int, sharded: bool) -> float:
        return n * bytes_each / world_size if sharded else float(n * bytes_each)

    return MemoryPerRank(part(per.params, stage >= 3), part(per.grads, stage >= 2), part(per.optimizer, stage >= 1))


# ---------------------------------------------------------------- sharding layouts

def chunk_sizes(n: int, world_size: int) -> list[int]:
    """Sizes of `torch.chunk(tensor_of_n, world_size)` per rank, 0 for ranks past the last chunk.

    torch.chunk makes chunks of ceil(n / world_size) and a shorter last one; it
    may make fewer than world_size chunks (n=5, 4 ranks: 2, 2, 1 and nothing
    for rank 3). FSDP1 and FSDP2 both shard this way, then pad to the first chunk.
    """
    chunk = -(-n // world_size)
    return [max(0, min(chunk, n - rank * chunk)) for rank in range(world_size)]


@dataclasses.dataclass(frozen=True)
class FlatShard:
    """One rank's shard of an FSDP1 FlatParameter.

    `start`/`end` (end exclusive) index the unsharded FlatParameter, which with
    use_orig_params=True also holds FSDP's alignment padding; `numel` counts
    real parameter elements; `padding` is the zeros FSDP appends to this shard
    so all ranks are equal (`flat_param._shard_numel_padded`); `align_padding`
    counts FlatParameter padding elements (alignment, world-size divisibility)
    inside [start, end). `pieces`: (param name, first, last_exclusive) element
    ranges of each original parameter (flattened) on this rank, in order.
    """

    rank: int
    start: int
    end: int
    numel: int
    padding: int
    pieces: list[tuple[str, int, int]]
    align_padding: int = 0

    @property
    def shard_numel(self) -> int:
        """The local FlatParameter's numel: the same on every rank."""
        return self.numel + self.align_padding + self.padding


def fsdp1_flat_shards(named_numels: list[tuple[str, int]], world_size: int, *,
                      element_size: int = 4, use_orig_params: bool = False) -> list[FlatShard]:
    """FSDP1's FlatParameter layout for one FSDP unit, every rank (torch 2.13 `_flat_param.py`).

    `named_numels`: the unit's own parameters in `named_parameters()` order.
    FSDP1 concatenates them into one flat tensor. With use_orig_params=True it
    first pads before each parameter so every one starts on a 16-byte boundary
    (`_get_aligned_numel`: 16 // element_size elements; element_size is that of
    the dtype forward runs in) and pads the total to a multiple of world_size
    (`_init_flat_param_and_metadata`). Then `_get_shard` takes torch.chunk's
    piece for the rank and pads it to the first chunk's size.
    """
    # The unsharded FlatParameter: (name or None for padding, numel) segments.
    segments: list[tuple[str | None, int]] = []
    total = 0
    aligned = 16 // element_size if use_orig_params else 0
    for name, numel in named_numels:
        if aligned and total % aligned:
            segments.append((None, aligned - total % aligned))
            total += aligned - total % aligned
        segments.append((name, numel))
        total += numel
    if aligned and total % world_size:
        segments.append((None, world_size - total % world_size))
        total += world_size - total % world_size

    sizes = chunk_sizes(total, world_size)
    shards = []
    for rank, size in enumerate(sizes):
        start = min(rank * sizes[0], total)
        end = start + size
        pieces, numel, align_padding, offset = [], 0, 0, 0
        for name, seg_numel in segments:
            lo, hi = max(start, offset), min(end, offset + seg_numel)
            if lo < hi:
                if name is None:
                    align_padding += hi - lo
                else:
                    pieces.append((name, lo - offset, hi - offset))
                    numel += hi - lo
            offset += seg_numel
        shards.append(FlatShard(rank, start, end, numel, sizes[0] - size, pieces, align_padding))
    return shards


def fsdp2_local_shape(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, ...]:
    """The local shape of a parameter under FSDP2's Shard(0): torch.chunk's piece of dim 0.

    A rank past the last chunk keeps the other dims with 0 rows
    (`_get_dim_chunked_size` in `_fully_shard/_fsdp_common.py`).
    """
    return (chunk_sizes(shape[0], world_size)[rank], *shape[1:])


def fsdp2_padded_shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of a parameter's padded shard, what each rank feeds FSDP2's all-gather.

    Every rank pads its dim-0 chunk to the first chunk's rows, ceil(dim0 / N)
    (`padded_sharded_param_size` in `_fully_shard/_fsdp_param.py`).
    """
    return -(-shape[0] // world_size) * math.prod(shape[1:])


# ---------------------------------------------------------------- model sizes

def llama_param_count(*, hidden: int, layers: int, vocab: int, intermediate: int, heads: int,
                      kv_heads: int, tied_embeddings: bool = False, head_dim: int | None = None) -> int:
    """Parameters of a Llama (HF `LlamaForCausalLM`, no biases): Llama-2-7B gives 6,738,415,616.

    Per layer: q and o projections h x (heads*head_dim), k and v h x (kv_heads*head_dim)
    (grouped-query attention when kv_heads < heads), gate/up/down 3*h*intermediate,
    two RMSNorm weights of h. Plus the token embedding vocab x h, the final
    RMSNorm h, and the lm_head vocab x h unless tied to the embedding.
    """
    head_dim = head_dim if head_dim is not None else hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if tied_embeddings else 2)
    return embeddings + layers * per_layer + hidden
