"""01.allgather_from_broadcast: all-gather as N broadcasts (broadcast only), checked on 2 and 3 real ranks.

Judges: every rank returns rank r's tensor at entry r (int64 and float32), the input is left unchanged, and
exactly one broadcast per source rank. They recognise one buffer reused for every source (each entry then
holds the last rank's tensor) and entries that are the same tensor.
"""

from __future__ import annotations

from ...compare import each_result, first_difference, ops_called
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import _case_label, _int64, _integer_tensors

__all__ = ["ALLGATHER"]


def _gathered(outcome: RunOutcome) -> list[str]:
    """Judge: every rank returns a list of N distinct tensors, entry r equal to rank r's input."""
    import torch

    n = outcome.nproc
    for case, rank, result in each_result(outcome):
        expected = [outcome.inputs[case][r][0] for r in range(n)]
        out = result.output
        where = f"rank {rank}, {_case_label(outcome, case)}"
        if "list" not in out:
            return [f"{where}: returned a {out['not_a_tensor_list']}, expected a list of {n} tensors"]
        got = out["list"]
        if len(got) != n:
            return [f"{where}: returned {len(got)} tensors, expected {n} (one per rank)"]
        shared = [(i, j) for i, others in enumerate(out["shared"]) for j in others if i < j]
        if shared:
            i, j = shared[0]
            return [f"{where}: entries {i} and {j} are the same tensor; give each rank's data its own "
                    "buffer (clone, or a new torch.empty_like per broadcast)"]
        for src in range(n):
            wrong = first_difference(got[src], expected[src])
            if wrong:
                hint = ""
                if src != n - 1 and torch.equal(got[src], expected[n - 1]):
                    hint = f": it holds rank {n - 1}'s tensor, the last one broadcast; one buffer reused?"
                return [f"{where}: entry {src} (rank {src}'s tensor): {wrong}{hint}"]
    return []


def _input_unchanged(outcome: RunOutcome) -> list[str]:
    """Judge: the tensor each rank was given is unchanged afterwards."""
    for case, rank, result in each_result(outcome):
        wrong = first_difference(result.output["input_after"], outcome.inputs[case][rank][0])
        if wrong:
            return [f"rank {rank}, {_case_label(outcome, case)}: the input tensor was changed ({wrong}); "
                    "receive other ranks' data into new buffers"]
    return []


def _one_broadcast_per_rank(outcome: RunOutcome) -> list[str]:
    """Judge: each rank calls broadcast exactly N times (one per source) and nothing else."""
    n = outcome.nproc
    for case, rank, result in each_result(outcome):
        ops = ops_called(result.ledger)
        if set(ops) - {"broadcast"}:
            return [f"rank {rank} called {', '.join(sorted(set(ops) - {'broadcast'}))}; only broadcast is allowed"]
        if len(ops) != n:
            return [f"rank {rank}, {_case_label(outcome, case)}: {len(ops)} broadcasts, expected {n} (one per source rank)"]
    return []


ALLGATHER = Exercise(
    id="01.allgather_from_broadcast",
    function="all_gather_by_broadcast",
    signature="all_gather_by_broadcast(tensor: torch.Tensor) -> list[torch.Tensor]",
    driver="returns_tensor_list",
    hints=(
        "Reread lesson 01, section 4 'Collectives': what broadcast does to the tensor it is given, on the "
        "source rank and on every other rank.",
        "dist.broadcast(tensor, src=...), with Tensor.clone and torch.empty_like for the buffers.",
        "Take every rank in turn as the source. The source gives broadcast a copy of its own tensor, every "
        "other rank a new buffer of the same shape and dtype to receive into; keep the buffers in a list in "
        "rank order, one new buffer per source, since broadcast writes into the buffer it is given.",
    ),
    allowed_ops=frozenset({"broadcast"}),
    required_ops=frozenset({"broadcast"}),
    runs=(
        RunSpec(2, lambda n: (_integer_tensors(n, [(3,)], seed=201, dtype=_int64())
                              + _integer_tensors(n, [(2, 2)], seed=202)),
                (Item("gathers on 2 ranks (int64 and float32)", 1, _gathered),)),
        RunSpec(3, lambda n: _integer_tensors(n, [(5,)], seed=203),
                (Item("gathers on 3 ranks", 1, _gathered),
                 Item("leaves the input tensor unchanged", 1, _input_unchanged),
                 Item("exactly one broadcast per source rank", 1, _one_broadcast_per_rank))),
    ),
)
