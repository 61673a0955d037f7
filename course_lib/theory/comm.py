"""Communication the lessons predict: ring collectives, and what DDP, FSDP2 and TP send per step.

Ring collectives (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce
algorithms for clusters of workstations"; the NCCL docs' performance notes):
a ring all-reduce is a reduce-scatter then an all-gather, each N-1 steps in
which every rank sends 1/N of the data to its right neighbour, so a rank sends
2(N-1)/N of the tensor in all, whatever N. The step functions give the
sequence of (op, input bytes) a rank's collective ledger records in one
training step, measured on torch 2.13 (see the docstrings). Units are bytes.
Re-exported by `course_lib.theory`.
"""

from __future__ import annotations

import math

from ..vocabulary import FSDP_ALL_GATHER_OP, FSDP_REDUCE_SCATTER_OP

__all__ = [
    "ddp_step_bytes", "fsdp2_step_collectives", "ring_all_gather_bytes", "ring_all_reduce_bytes",
    "ring_all_reduce_schedule", "ring_reduce_scatter_bytes", "ring_time_s", "tp_layer_comm",
    "zero_step_sent_bytes",
]


# ---------------------------------------------------------------- ring collectives

def ring_all_reduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of an `nbytes` tensor: 2(N-1)/N * nbytes."""
    return 2 * (world_size - 1) / world_size * nbytes


def ring_all_gather_bytes(output_nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-gather whose gathered output is `output_nbytes`: (N-1)/N of it."""
    return (world_size - 1) / world_size * output_nbytes


def ring_reduce_scatter_bytes(input_nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of an `input_nbytes` input: (N-1)/N of it."""
    return (world_size - 1) / world_size * input_nbytes


_RING = {  # op -> (steps per (N-1), bytes-sent formula)
    "all_reduce": (2, ring_all_reduce_bytes),
    "all_gather": (1, ring_all_gather_bytes),
    "reduce_scatter": (1, ring_reduce_scatter_bytes),
}


def ring_time_s(op: str, nbytes: float, world_size: int, *, latency_s: float,
                bandwidth_bytes_per_s: float) -> float:
    """Alpha-beta time of a ring collective: steps * latency + bytes sent / bandwidth.

    `op`: "all_reduce" (nbytes: the tensor), "all_gather" (nbytes: the gathered
    output) or "reduce_scatter" (nbytes: the full input). A ring all-reduce
    takes 2(N-1) steps, the other two N-1 (Patarasuk & Yuan; NCCL performance docs).
    """
    if op not in _RING:
        raise ValueError(f"op must be one of {sorted(_RING)}, not {op!r}")
    steps, sent = _RING[op]
    return steps * (world_size - 1) * latency_s + sent(nbytes, world_size) / bandwidth_bytes_per_s


def ring_all_reduce_schedule(world_size: int) -> list[list[tuple[int, int, int, str]]]:
    """Every transfer of a ring all-reduce over N chunks: per step a list of (src, dst, chunk, phase).

    Convention: rank r always sends to (r + 1) mod N. Reduce-scatter step s
    (s = 0..N-2): rank r sends chunk (r - s) mod N, the receiver adds it to its
    own; afterwards rank r holds the full sum of chunk (r + 1) mod N.
    All-gather step s: rank r sends chunk (r + 1 - s) mod N, the receiver
    overwrites its copy. 2(N-1) steps; each moves one chunk per rank.
    """
    n = world_size
    steps = [[(r, (r + 1) % n, (r - s) % n, "reduce-scatter") for r in range(n)] for s in range(n - 1)]
    steps += [[(r, (r + 1) % n, (r + 1 - s) % n, "all-gather") for r in range(n)] for s in range(n - 1)]
    return steps


# ---------------------------------------------------------------- data parallel steps

def zero_step_sent_bytes(weight_bytes: float, grad_bytes: float, world_size: int, *, stage: int) -> dict[str, float]:
    """Bytes each rank sends per training step on rings, by collective, for ZeRO stage 0 (DDP) to 3 (FSDP).

    Stage 0 all-reduces the gradients. Stages 1 and 2 reduce-scatter the gradients
    and all-gather the updated weights: the same volume as DDP (ZeRO paper,
    arXiv:1910.02054, section 7). Stage 3 all-gathers the weights twice (forward,
    and again in backward because they were freed) and reduce-scatters the
    gradients: 1.5x DDP. `weight_bytes`/`grad_bytes`: the whole model's, unsharded.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 0:
        return {"all_reduce": ring_all_reduce_bytes(grad_bytes, world_size)}
    return {"reduce_scatter": ring_reduce_scatter_bytes(grad_bytes, world_size),
            "all_gather": (2 if stage == 3 else 1) * ring_all_gather_bytes(weight_bytes, world_size)}


def ddp_step_bytes(grad_numels: list[int], *, element_size: int = 4) -> dict[str, int]:
    """Input bytes DDP all-reduces per training step: every gradient once, {"all_reduce": total}.

    DDP packs gradients into buckets (25 MiB each by default) and all-reduces
    each bucket as one flat tensor, so the total is the sum of all gradients
    whatever the bucketing. DDP's own all-reduce runs in C++; the ledger sees
    it when the stock `allreduce_hook` issues it from Python.
    """
    return {"all_reduce": sum(grad_numels) * element_size}


def fsdp2_step_collectives(units: list[list[tuple[int, ...]]], world_size: int, *, element_size: int = 4,
                           reshard_after_forward: bool = True, root_reshard_after_forward: bool = False,
                           inputs_require_grad: bool = False) -> list[tuple[str, int]]:
    """The (op, input bytes) sequence FSDP2 issues on each rank in one training step (torch 2.13).

    `units`: each `fully_shard` unit's parameter shapes, blocks in forward
    order, the root (the model itself: the parameters no block took) last.
    A unit's all-gather input is the concatenation of its parameters' padded
    shards (`foreach_all_gather`); its reduce-scatter input is the padded
    unsharded gradients, N times that (`foreach_reduce`). Measured order:
    forward gathers the root first (its forward starts first), then each
    block. The root is not resharded after forward (fully_shard's default
    for the root), blocks are unless `reshard_after_forward=False`, so
    backward re-gathers the blocks in reverse order, each block's pre-backward
    prefetching the next one's all-gather before its own reduce-scatter.
    The first block's reduce-scatter waits for the end of backward (after the
    root's) when the model's inputs do not require grad, as for the toy model.
    Every step is the same, the first included; the optimizer step and
    `fully_shard` itself issue none; at world_size 1 FSDP2 issues none.
    """
    if world_size == 1:
        return []
    gathered = [sum(_padded(shape, world_size) for shape in unit) * element_size for unit in units]
    ag = [(FSDP_ALL_GATHER_OP, nbytes) for nbytes in gathered]
    rs = [(FSDP_REDUCE_SCATTER_OP, nbytes * world_size) for nbytes in gathered]
    *blocks, root = range(len(units))
    ops = [ag[root]] + [ag[b] for b in blocks]  # forward
    if root_reshard_after_forward:
        ops.append(ag[root])
    unsharded = set() if reshard_after_forward else set(blocks)
    for i in reversed(blocks):
        for b in (i, i - 1):  # this block, then the prefetch of the one backward reaches next
            if b >= 0 and b not in unsharded:
                ops.append(ag[b])
                unsharded.add(b)
        if i > 0 or inputs_require_grad:
            ops.append(rs[i])
    if blocks and not inputs_require_grad:
        return ops + [rs[root], rs[blocks[0]]]  # both in FSDP2's end-of-backward callback, root first
    return ops + [rs[root]]


def _padded(shape: tuple[int, ...], world_size: int) -> int:
    # theory.fsdp2_padded_shard_numel, repeated here: theory imports this module.
    return -(-shape[0] // world_size) * math.prod(shape[1:])


# ---------------------------------------------------------------- tensor parallelism

def tp_layer_comm(batch: int, seq: int, hidden: int, tp: int, *, element_size: int = 2,
                  sequence_parallel: bool = False) -> dict[str, list[tuple[str, int]]]:
    """Collectives of one Megatron transformer layer (attention + MLP) per rank, in execution order.

    Without sequence parallelism (Megatron-LM, arXiv:1909.08053, section 3):
    the g operator after each row-parallel output projection all-reduces the
    b*s*h activation in forward, and the f operator at each block's input
    all-reduces its gradient in backward: 2 + 2 all-reduces per layer.
    With sequence parallelism (arXiv:2205.05198, section 4.2.2) each all-reduce
    becomes an all-gather (before the block, g) and a reduce-scatter (after it,
    g-bar), and backward swaps them. Bytes are the full b*s*h tensor (the
    all-gather's output, the reduce-scatter's input), so a ring moves the same
    bytes either way. tp=1: no communication.
    """
    if tp == 1:
        return {"forward": [], "backward": []}
    nbytes = batch * seq * hidden * element_size
    if not sequence_parallel:
        return {"forward": [("all_reduce", nbytes)] * 2, "backward": [("all_reduce", nbytes)] * 2}
    block = [("all_gather", nbytes), ("reduce_scatter", nbytes)]
    return {"forward": block * 2, "backward": block * 2}
