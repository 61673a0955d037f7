"""Lesson 03's predictions (see course_lib/predictions/__init__.py).

- 03.shadow_allreduces: under `Join`, how many gradient all-reduces rank 0 takes part in, and how many of
  them are shadows (section 3's third run, the one whose gradient all-reduces the ledger sees).
- 03.zero_state_bytes: the bytes of Adam's `exp_avg` + `exp_avg_sq` each of 2 ranks holds under
  ZeroRedundancyOptimizer (section 6), from its greedy partition of whole tensors.
"""

from __future__ import annotations

from typing import Mapping

from .spec import Prediction, Tolerance

__all__ = ["PREDICTIONS", "greedy_shares"]


def greedy_shares(numels: list[int], world_size: int) -> list[int]:
    """Elements each rank owns when whole tensors go, largest first, to the rank holding the fewest so far
    (the lowest rank on a tie): the rule section 6 states, ZeroRedundancyOptimizer's."""
    shares = [0] * world_size
    for numel in sorted(numels, reverse=True):
        shares[shares.index(min(shares))] += numel
    return shares


def _gradient_allreduces(results: Mapping, ledgers: Mapping) -> tuple[int, int]:
    """Rank 0's all-reduces of the gradient bucket's size in run 3 (after run 2 ended), and how many
    of them started after its loop ran out of data."""
    run = results["run_2"][0]
    since, until, out_of_data = results["run_1"][0]["end"], run["end"], run["out_of_data"]
    size = results["grad_bytes"][0]
    calls = [e for e in ledgers[0] if e.get("op") == "all_reduce" and e.get("bytes") == size
             and since < e["start"] < until]
    return len(calls), sum(1 for e in calls if e["start"] > out_of_data)


def _shadow_formula(results: Mapping) -> tuple[int, int]:
    """Rank 0 takes part in every step of the rank with the most batches; the steps after its own are shadows."""
    counts = [results["join_batches"][r] for r in sorted(results["join_batches"])]
    return max(counts), max(counts) - counts[0]


def _state_bytes(results: Mapping, ledgers: Mapping) -> tuple[int, ...]:
    measured = results["zero_state_bytes"]
    return tuple(measured[r] for r in sorted(measured))


def _state_formula(results: Mapping) -> tuple[int, ...]:
    """Two float32 moments (8 bytes) per element a rank owns."""
    numels = results["zero_numels"][0]
    return tuple(8 * share for share in greedy_shares(numels, len(results["zero_numels"])))


PREDICTIONS: dict[str, Prediction] = {
    "03.shadow_allreduces": Prediction(
        id="03.shadow_allreduces",
        question="rank 0's 848-byte all-reduces under Join, and how many of them were shadows",
        needs="run_2",
        measure=_gradient_allreduces,
        formula=_shadow_formula,
        explanation=("a rank that has run out does not leave the others alone: until every rank has joined, it "
                     "runs DDP's join hook once per step of the ranks still training, and that hook all-reduces a "
                     "bucket of zeros where the gradients would be. So rank 0 takes part in as many gradient "
                     "all-reduces as the rank with the most batches takes steps (3), and the ones after its own 2 "
                     "batches are shadows (1)."),
        unit="",
        tolerance=Tolerance(),
    ),
    "03.zero_state_bytes": Prediction(
        id="03.zero_state_bytes",
        question="bytes of exp_avg + exp_avg_sq on rank 0 and on rank 1 under ZeRO",
        needs="zero_state_bytes",
        measure=_state_bytes,
        formula=_state_formula,
        explanation=("ZeRO hands out whole tensors, largest first, each to the rank that holds the fewest elements "
                     "so far: the 128-element weight goes to rank 0; then 64, 16 and 4 all go to rank 1, which "
                     "still holds fewer (64, then 80, then 84). Two float32 moments are 8 bytes per element: "
                     "128 x 8 = 1,024 on rank 0 and 84 x 8 = 672 on rank 1, not 848 each."),
        unit="B",
        tolerance=Tolerance(),
    ),
}
