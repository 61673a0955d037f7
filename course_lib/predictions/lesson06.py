"""Lesson 06's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/06_tensor_parallel.ipynb published (`cl.results`) and from
the ledger of the cell that published it, and checks it against the formula: DTensor's `Partial` ->
`Shard(1)` on an uneven split (one reduce-scatter, torch.chunk's pieces: the last rank's empty), Megatron's
MLP (cl.theory's `tp_layer_comm`, its MLP half) and the bytes of a 2-D (dp x tp) layout from the parameters'
shapes.
"""

from __future__ import annotations

import math

from ..theory import chunk_sizes, tp_layer_comm
from .spec import Prediction

__all__ = ["PREDICTIONS"]

FLOWS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _redistribute_measured(results, ledgers) -> tuple:
    by_rank = results["partial"]
    first, _, calls, _ = by_rank[0]["Shard(1)"]
    last = by_rank[max(by_rank)]["Shard(1)"][0]
    names = [name for name, _, _ in calls]
    return (*(names.count(flow) for flow in FLOWS), first[1], last[1])


def _redistribute_formula(results) -> tuple:
    cols, world = 3, 4  # x [8, 4] Shard(1) @ w [4, 3] Shard(0) on the 4-rank mesh: an 8 x 3 Partial
    pieces = chunk_sizes(cols, world)  # torch.chunk's columns per rank: 1, 1, 1, 0
    return 0, 0, 1, pieces[0], pieces[-1]


def _mlp_bytes_measured(results, ledgers) -> int:
    return sum(e["bytes"] for e in ledgers[0] if e["op"] == "all_reduce")


def _mlp_bytes_formula(results) -> int:
    batch, hidden = results["by_hand"][0]["x"]
    layer = tp_layer_comm(batch, 1, hidden, len(results["by_hand"]), element_size=4)
    # A transformer layer is attention + MLP, each with one g (forward) and one f (backward): the MLP is half.
    return sum(nbytes for phase in layer.values() for _, nbytes in phase[:1])


def _memory_2d_formula(results) -> int:
    published = results["memory"][0]
    dp, tp = published["mesh"]
    total = 0
    for name, shape in published["shapes"].items():
        numel = math.prod(shape)
        total += numel // (tp if name in published["tp sharded"] else 1) // dp
    return 4 * total


PREDICTIONS: dict[str, Prediction] = {
    "06.redistribute": Prediction(
        id="06.redistribute",
        question="Partial() -> Shard(1) of the 8 x 3 product on 4 ranks: (all-reduces, all-gathers, "
                 "reduce-scatters, columns rank 0 holds, columns rank 3 holds)",
        needs="partial",
        measure=_redistribute_measured,
        formula=_redistribute_formula,
        explanation=("each rank holds an 8 x 3 term; the target is the sum, cut by columns as torch.chunk cuts "
                     "3 columns in 4: 1, 1, 1 and nothing. One reduce-scatter does it (each rank receives the sum "
                     "of its own piece only): DTensor pads the input to 4 columns so that the pieces are equal, "
                     "and the last rank's piece is 8 x 0: rank 0 holds 1 column, rank 3 none."),
    ),
    "06.tp_mlp_bytes": Prediction(
        id="06.tp_mlp_bytes",
        question="bytes rank 0 all-reduces in one forward + backward of the by-hand TP MLP",
        needs="by_hand",
        measure=_mlp_bytes_measured,
        formula=_mlp_bytes_formula,
        explanation=("two all-reduces, each of a whole 4 x 8 float32 activation (128 bytes): g sums the "
                     "row-parallel layer's output terms in forward, f sums the gradient of x in backward. "
                     "Nothing the size of the 16-wide hidden layer moves: it stays split by columns. The "
                     "bytes grow with the batch (and sequence), not with the weights."),
        unit="B",
    ),
    "06.memory_2d": Prediction(
        id="06.memory_2d",
        question="bytes of parameters rank 0 holds under 2-D (dp 2 x tp 2)",
        needs="memory",
        measure=lambda results, ledgers: results["memory"][0]["2-D"],
        formula=_memory_2d_formula,
        explanation=("TP halves the 26,624 parameters of the Linears and the embedding (13,312 left) and keeps "
                     "the 160 norm weights whole (13,472); fully_shard over dp then halves every one of them "
                     "again (6,736 parameters), times 4 bytes. Every dimension here divides evenly, so FSDP adds "
                     "no padding."),
        unit="B",
    ),
}
