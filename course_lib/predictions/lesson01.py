"""Lesson 01's predictions (see course_lib/predictions/__init__.py).

- `01.ring_bytes` (section 3): the bytes each rank sends in the ring that passes whole tensors,
  read where they arrive (rank r's right neighbour received everything rank r sent).
- `01.all_to_all` (section 4): what rank 2 holds after `all_to_all` of the chunk grid of section 1.
"""

from __future__ import annotations

from typing import Mapping

from .spec import Prediction, Tolerance

__all__ = ["PREDICTIONS"]


def _bytes_sent_by_each_rank(results: Mapping, ledgers: Mapping) -> int:
    """Bytes rank r sent, counted from what its right neighbour received; the same on every rank."""
    ring = results["ring"]
    world = len(ring)
    sent = {rank: sum(t.numel() * t.element_size() for t in ring[(rank + 1) % world]["received"]) for rank in ring}
    if len(set(sent.values())) != 1:
        return tuple(sent[rank] for rank in sorted(sent))  # unequal ranks: never equal to the formula's one number
    return sent[0]


def _ring_formula(results: Mapping) -> int:
    """(N-1) steps, each sending one whole tensor of S bytes: (N-1) * S."""
    ring = results["ring"]
    tensor = ring[0]["total"]  # same shape and dtype as each rank's input
    return (len(ring) - 1) * tensor.numel() * tensor.element_size()


def _rank2_after_all_to_all(results: Mapping, ledgers: Mapping) -> tuple:
    return tuple(results["exchanges"][2]["all_to_all"].tolist())


def _all_to_all_formula(results: Mapping) -> tuple:
    """Rank j receives chunk j of every rank r, in rank order; chunk j of rank r is 10*r + j (section 1)."""
    world = len(results["exchanges"])
    return tuple(float(10 * rank + 2) for rank in range(world))


PREDICTIONS: dict[str, Prediction] = {
    "01.ring_bytes": Prediction(
        id="01.ring_bytes",
        question="bytes each rank sends in the ring of section 3 (4 ranks, 2 float32 numbers each)",
        needs="ring",
        measure=_bytes_sent_by_each_rank,
        formula=_ring_formula,
        explanation=("the ring takes N-1 = 3 steps and in each a rank sends one whole tensor of S = 2 x 4 = 8 "
                     "bytes, so (N-1) x S = 24 bytes per rank. That grows with N: on 1024 ranks a rank would "
                     "send 1023 copies of its tensor's size. Section 8's chunked ring sends less than 2 x S "
                     "per rank on any number of ranks."),
        unit="B",
        tolerance=Tolerance(),
    ),
    "01.all_to_all": Prediction(
        id="01.all_to_all",
        question="what rank 2 holds after all_to_all on 4 ranks",
        needs="exchanges",
        measure=_rank2_after_all_to_all,
        formula=_all_to_all_formula,
        explanation=("all_to_all sends chunk j of every rank to rank j, where it lands at the sender's "
                     "position: rank 2 receives chunk 2 of ranks 0, 1, 2, 3, which is 10 x r + 2: column 2 of "
                     "the grid of section 1. Nothing is added up (that is reduce_scatter): the grid is "
                     "transposed."),
        unit="",
        tolerance=Tolerance(),
    ),
}
