"""What lesson 06's exercises share: tolerances, the MLP and its weights, where a result came from, and the
ledger read phase by phase.

Every run is on CPU ranks (gloo). Weights and batches are drawn here, in the checker's process, from fixed
seeds; the references are one process, computed here without torch.distributed.
"""

from __future__ import annotations

import functools
from typing import Callable

from ....vocabulary import data_flow
from ...compare import each_result
from ...spec import RunOutcome
# One process's tolerances and weights are lesson 04's.
from ..lesson04.common import ATOL, RTOL, draw_batch, draw_weights

__all__ = ["ATOL", "MLP_DIM", "MLP_HIDDEN", "RTOL", "draw_batch", "draw_weights", "flows", "judge_each",
           "mlp_weights", "not_a_module", "not_returned", "own_backward", "where"]

MLP_DIM, MLP_HIDDEN = 8, 16  # hidden divides by 2 and 4


def where(rank: int, case: int, outcome: RunOutcome) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks)"


def not_returned(outcome: RunOutcome, expected: str) -> list[str]:
    """One line if the learner's code gave something else than `expected` on some rank (the driver says
    "returned")."""
    for case, rank, result in each_result(outcome):
        if "returned" in result.output:
            return [f"{where(rank, case, outcome)}: got a {result.output['returned']}, expected {expected}"]
    return []


def not_a_module(outcome: RunOutcome) -> list[str]:
    """One line if the learner's class did not make an nn.Module on some rank."""
    return not_returned(outcome, "an nn.Module")


Check = Callable[[RunOutcome, int, int, object], list[str]]


def judge_each(before: Callable[[RunOutcome], list[str]]) -> Callable[[Check], Callable[[RunOutcome], list[str]]]:
    """Turns `check(outcome, case, rank, result)`, which judges one rank's result, into a judge of the outcome:
    `before(outcome)` first (its problem returned as it is), then `check` on each result (cases in order, ranks
    sorted); the first problem found is returned, [] if none."""
    def wrap(check: Check) -> Callable[[RunOutcome], list[str]]:
        @functools.wraps(check)
        def judge(outcome: RunOutcome) -> list[str]:
            problem = before(outcome)
            if problem:
                return problem
            for case, rank, result in each_result(outcome):
                problem = check(outcome, case, rank, result)
                if problem:
                    return problem
            return []
        return judge
    return wrap


def mlp_weights(seed: int) -> dict:
    """Linear(8, 16) -> GELU -> Linear(16, 8)'s state dict (keys 0.* and 2.*), drawn from `seed`."""
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(MLP_DIM, MLP_HIDDEN), torch.nn.GELU(),
                                   torch.nn.Linear(MLP_HIDDEN, MLP_DIM))
    return draw_weights(build, seed)


def own_backward(result, at: str, what: str, into: str) -> list[str]:
    """One line if the gradient of `what` was not computed by the learner's own autograd.Function (the driver's
    "autograd": the node autograd differentiated itself, or "not an input"), [] if it was. The rule, the same in
    both vocabulary exercises: one torch.autograd.Function whose backward the learner writes."""
    reached = result.output.get("autograd")
    if not reached:
        return []
    how = (f"{what} never went into a torch.autograd.Function of your cell" if reached == "not an input"
           else f"autograd differentiated your code itself ({reached} reaches {what})")
    return [f"{at}: the gradient of {what} did not come from a backward you wrote: {how}; the exercise asks for "
            f"one torch.autograd.Function with your own backward, {into} passed into it"]


def flows(result, span: list[float]) -> list[str]:
    """The data flows (all_reduce, all_gather, reduce_scatter, ...) this rank's ledger shows between the two times of
    `span`, in order: the calls the learner made in forward, or in backward."""
    start, stop = span
    return [data_flow(e["op"]) or e["op"] for e in result.ledger if start <= e["start"] <= stop]
