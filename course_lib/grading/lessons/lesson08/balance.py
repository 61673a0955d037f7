"""08.balance: cut layers with given costs into consecutive stages so that the slowest stage is as fast as it
can be (a pipeline's step runs at its slowest stage's pace).

Judged against the optimum found by trying every cut (the cases are small): a valid split (`stages` counts,
each at least 1, adding up to the layers), and its slowest stage's cost equal to the optimum. Equal layer
counts and a greedy fill up to the average cost are recognised and named.
"""

from __future__ import annotations

import itertools

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["BALANCE", "equal_counts", "greedy_to_average", "optimum", "slowest"]

# (layer costs, stages): each beaten by both equal counts and a greedy fill to the average, but the first and
# the third (where the even split is the only one). In the last, a greedy fill under the best bound (8) makes
# 3 stages of 4: an answer must still return `stages` counts.
CASES = (
    ((1, 2, 3, 4, 5, 6, 7, 8), 2),
    ((4, 8, 9, 9, 8, 7, 3), 4),
    ((3, 3, 3, 3), 4),
    ((4, 1, 5, 1, 2, 2, 9, 1, 4), 3),
    ((5, 8, 1, 1, 1, 6, 5), 3),
    ((4, 8, 2, 2, 2), 4),
)

HINTS = (
    "Lesson 08's slots (section 5) take every stage's forward as equally long; when stages differ, every slot "
    "lasts as long as the slowest stage's, so the step runs at its pace. Cutting the model is section 1's "
    "stage_of, here with layers of unequal cost.",
    "Plain Python: sum, max, itertools.combinations (every cut), or a binary search over the answer; no "
    "torch.distributed call is needed.",
    "A cut is stages - 1 positions between layers; the cost of a cut is its most expensive stage. The cases are "
    "small enough to try every cut and keep the cheapest; for large ones, ask for each bound whether a greedy "
    "fill that never passes the bound needs at most `stages` stages, and find the smallest bound that does; then "
    "split groups until there are exactly `stages`, each with at least one layer.",
)


def slowest(costs, split) -> int:
    """The cost of the slowest stage of `split` (layers per stage, in order)."""
    bounds = list(itertools.accumulate(split, initial=0))
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def optimum(costs, stages: int) -> int:
    """The least cost of a slowest stage over every cut (exhaustive: the cases are small)."""
    n = len(costs)
    return min(slowest(costs, [b - a for a, b in zip((0, *cut), (*cut, n))])
               for cut in itertools.combinations(range(1, n), stages - 1))


def equal_counts(costs, stages: int) -> list[int]:
    q, r = divmod(len(costs), stages)
    return [q + (1 if s < r else 0) for s in range(stages)]


def greedy_to_average(costs, stages: int) -> list[int]:
    """Each stage but the last takes layers until its cost reaches the average (leaving one per later stage)."""
    average, split, i = sum(costs) / stages, [], 0
    for s in range(stages - 1):
        k, total = 0, 0
        while i + k < len(costs) - (stages - 1 - s) and (k == 0 or total < average):
            total += costs[i + k]
            k += 1
        split.append(k)
        i += k
    return [*split, len(costs) - i]


def _label(costs, stages) -> str:
    return f"balance_stages({list(costs)}, {stages})"


def _invalid(costs, stages, out) -> str:
    if out["returned"]:
        return f"returned a {out['returned']}, not a list of ints (layers per stage)"
    split = out["split"]
    if len(split) != stages:
        said = f"returned {split}: {len(split)} counts for {stages} stages"
        if len(split) < stages and min(split, default=0) >= 1 and sum(split) == len(costs):
            said += ("; a greedy fill under the best bound can need fewer stages than there are: split a group "
                     "until every stage has a layer")
        return said
    if min(split) < 1:
        return f"returned {split}: every stage needs at least one layer"
    if sum(split) != len(costs):
        said = f"returned {split}, {sum(split)} layers in all; there are {len(costs)}"
        if sum(split) == sum(costs):
            said += ": these add up to the layers' total cost; return how many layers each stage gets"
        return said
    return ""


def _each(outcome: RunOutcome):
    for case, rank, result in each_result(outcome):
        for (costs, stages), out in zip(outcome.inputs[case][rank][0], result.output):
            yield rank, costs, stages, out


def _valid(outcome: RunOutcome) -> list[str]:
    for rank, costs, stages, out in _each(outcome):
        wrong = _invalid(costs, stages, out)
        if wrong:
            return [f"rank {rank}, {_label(costs, stages)} {wrong}"]
    return []


def _optimal(outcome: RunOutcome) -> list[str]:
    for rank, costs, stages, out in _each(outcome):
        if _invalid(costs, stages, out):
            return [f"rank {rank}, {_label(costs, stages)}: not a valid split (the item above says why)"]
        got, best = slowest(costs, out["split"]), optimum(costs, stages)
        if got == best:
            continue
        said = (f"rank {rank}, {_label(costs, stages)} returned {out['split']}: its slowest stage costs {got}, "
                f"a cut exists whose slowest costs {best}")
        if out["split"] == equal_counts(costs, stages):
            said += ": equal layer counts ignore the costs"
        elif out["split"] == greedy_to_average(costs, stages):
            said += (": filling each stage up to the average cost decides each cut alone, and one stage's "
                     "overshoot lands on the next; compare whole cuts")
        return [said]
    return []


BALANCE = Exercise(
    id="08.balance",
    function="balance_stages",
    signature="balance_stages(layer_costs: list[int], stages: int) -> list[int]",
    driver="balance",
    hints=HINTS,
    runs=(
        RunSpec(2, lambda n: [{r: (list(CASES[r::n]),) for r in range(n)}],
                (Item("a valid split on every case: stages counts, each at least 1, adding up to the layers "
                      "(2 ranks)", 1, _valid),
                 Item("the slowest stage as fast as any cut allows, on cases with known optima (2 ranks)", 2,
                      _optimal)),
                timeout_s=15),
    ),
)
