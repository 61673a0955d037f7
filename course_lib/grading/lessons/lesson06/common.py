"""What lesson 06's exercises share: tolerances, the MLP and its weights, where a result came from, and the
ledger read phase by phase.

Every run is on CPU ranks (gloo). Weights and batches are drawn here, in the checker's process, from fixed
seeds; the references are one process, computed here without torch.distributed.
"""

from __future__ import annotations

from ....vocabulary import data_flow
from ...compare import each_result
from ...spec import RunOutcome
# One process's tolerances and weights are lesson 04's.
from ..lesson04.common import ATOL, RTOL, draw_batch, draw_weights

__all__ = ["ATOL", "MLP_DIM", "MLP_HIDDEN", "RTOL", "draw_batch", "draw_weights", "flows", "mlp_weights",
           "not_a_module", "where"]

MLP_DIM, MLP_HIDDEN = 8, 16  # hidden divides by 2 and 4


def where(rank: int, case: int, outcome: RunOutcome) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks)"


def not_a_module(outcome: RunOutcome) -> list[str]:
    """One line if the learner's class did not make an nn.Module on some rank (the driver says "returned")."""
    for case, rank, result in each_result(outcome):
        if "returned" in result.output:
            return [f"{where(rank, case, outcome)}: got a {result.output['returned']}, expected an nn.Module"]
    return []


def mlp_weights(seed: int) -> dict:
    """Linear(8, 16) -> GELU -> Linear(16, 8)'s state dict (keys 0.* and 2.*), drawn from `seed`."""
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(MLP_DIM, MLP_HIDDEN), torch.nn.GELU(),
                                   torch.nn.Linear(MLP_HIDDEN, MLP_DIM))
    return draw_weights(build, seed)


def flows(result, span: list[float]) -> list[str]:
    """The data flows (all_reduce, all_gather, reduce_scatter, ...) this rank's ledger shows between the two times of
    `span`, in order: the calls the learner made in forward, or in backward."""
    start, stop = span
    return [data_flow(e["op"]) or e["op"] for e in result.ledger if start <= e["start"] <= stop]
