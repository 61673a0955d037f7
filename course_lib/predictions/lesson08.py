"""Lesson 08's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/08_pipeline.ipynb published (`cl.results`) and from the
ledger of the cell that published it: the bytes the naive split's boundary moves (the ledger's send and recv
records), rank 0's idle slots under GPipe and 1F1B on 4 ranks (from the order of actions each rank ran,
in slots of one forward or backward each), and the most microbatches whose saved activations rank 0 held.
"""

from __future__ import annotations

import math

from .spec import Prediction

__all__ = ["PREDICTIONS", "slots"]

SCHEDULES = ("GPipe m=8", "1F1B m=8")  # the 4-rank runs the questions ask about, in the questions' order


def slots(orders: dict[int, str]) -> dict[int, list[tuple[str, int]]]:
    """{rank: [(action, start slot), ...]} for the per-rank orders `orders` ({rank: "F0 F1 B0 ..."}), each
    action one slot long, starting as soon as its rank is free and its input has arrived: F<i> after the
    previous rank's F<i>, B<i> after the next rank's B<i> (the last rank's after its own F<i>, earlier in
    its order). Raises ValueError for orders that wait on each other forever."""
    p = len(orders)
    todo = {rank: orders[rank].split() for rank in sorted(orders)}
    ends: dict[tuple[int, str], int] = {}
    placed: dict[int, list[tuple[str, int]]] = {rank: [] for rank in todo}
    free = {rank: 0 for rank in todo}
    moved = True
    while moved:
        moved = False
        for rank, actions in todo.items():
            while actions:
                action = actions[0]
                needs = ((rank - 1, "F" + action[1:]) if action[0] == "F" and rank > 0 else
                         (rank + 1, "B" + action[1:]) if action[0] == "B" and rank < p - 1 else None)
                if needs is not None and needs not in ends:
                    break
                start = max(free[rank], ends[needs] if needs else 0)
                ends[(rank, action)] = free[rank] = start + 1
                placed[rank].append((action, start))
                actions.pop(0)
                moved = True
    stuck = {rank: actions[0] for rank, actions in todo.items() if actions}
    if stuck:
        raise ValueError(f"these orders wait on each other forever: {stuck}")
    return placed


def _idle_slots(orders: dict[int, str], rank: int = 0) -> int:
    placed = slots(orders)[rank]
    return placed[-1][1] + 1 - placed[0][1] - len(placed)


def _idle_measured(results, ledgers) -> tuple:
    runs = results["four"]
    return tuple(_idle_slots({rank: runs[rank][name]["order"] for rank in runs}) for name in SCHEDULES)


def _idle_formula(results) -> tuple:
    p = len(results["four"])
    # (p - 1) / (m + p - 1) of 2(m + p - 1) slots (m forwards and m backwards each way): 2(p - 1), any m.
    return 2 * (p - 1), 2 * (p - 1)


def _bytes_measured(results, ledgers) -> tuple:
    return tuple(sum(e["bytes"] for e in ledgers[0] if e["op"] == op) for op in ("send", "recv"))


def _bytes_formula(results) -> tuple:
    shape = results["naive"][0]["boundary"]  # the activation rank 0 sends: [rows, features], float32
    return 4 * math.prod(shape), 4 * math.prod(shape)  # forward its values, backward their gradient: same shape


PREDICTIONS: dict[str, Prediction] = {
    "08.boundary_bytes": Prediction(
        id="08.boundary_bytes",
        question="naive split of the 16-row batch on 2 ranks: bytes rank 0 sends, bytes it receives, per step",
        needs="naive",
        measure=_bytes_measured,
        formula=_bytes_formula,
        explanation=("rank 0 sends its output, one 16 x 16 float32 activation (16 x 16 x 4 = 1,024 bytes), and "
                     "receives the gradient of that output, the same shape: 1,024 bytes. The weights never "
                     "move: what crosses a stage boundary grows with the batch (rows x width), not with the "
                     "model, and cutting the batch into m microbatches only cuts it into m messages."),
        unit="B",
    ),
    "08.idle_slots": Prediction(
        id="08.idle_slots",
        question="4 ranks, m = 8: slots rank 0 is idle between its first and last action, GPipe and 1F1B",
        needs="four",
        measure=_idle_measured,
        formula=_idle_formula,
        explanation=("with every forward and backward one slot long, a step lasts 2(m + p - 1) = 22 slots and "
                     "rank 0 works 2m = 16 of them: 6 idle slots, 2(p - 1), the (p - 1)/(m + p - 1) = 3/11 of "
                     "the formula. Under GPipe they come in one block after its last forward: 3 slots while "
                     "microbatch 7's forward reaches rank 3, 3 while microbatch 0's gradient comes back. Under "
                     "1F1B, 3 come after its first 4 forwards (microbatch 0's forward goes out and its gradient "
                     "comes back) and 3 between its last 4 backwards, each waiting for the next gradient: 1F1B "
                     "starts backwards earlier, but the step is no shorter."),
        unit="slots",
    ),
    "08.peak_microbatches": Prediction(
        id="08.peak_microbatches",
        question="4 ranks, m = 8: most microbatches whose activations rank 0 holds at once, GPipe and 1F1B",
        needs="four",
        measure=lambda results, ledgers: tuple(results["four"][0][name]["peak"] for name in SCHEDULES),
        formula=lambda results: (8, len(results["four"])),
        explanation=("GPipe runs all 8 forwards before the first backward, so rank 0 holds the saved "
                     "activations of all m = 8 microbatches. 1F1B lets rank 0 run p - 1 = 3 forwards ahead, "
                     "then one forward before each backward: the 4th forward comes before the first backward "
                     "frees microbatch 0, so it holds p = 4 at most for any m ≥ p (min(m, p) in general)."),
        unit="microbatches",
    ),
}
