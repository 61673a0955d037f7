"""Lesson 10's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/10_moe_expert_parallel.ipynb published (`cl.results`) and from
the ledger of the cell that published it: the bytes rank 0's dispatch and combine all-to-alls put in when every
token goes to rank 0's experts (expert parallelism on 2 ranks, the ledger's `all_to_all_single` records), the
(token, expert) pairs rank 0 drops at capacity factor 1.0 (counted on the rank), the bytes of its padded
dispatch at capacity factor 1.25 (the ledger), and, under EP x DP on a ("dp_mod_ep", "ep") mesh, the number an
expert's gradient summed over its column must be divided by to equal one process's (the gradients rank 0
published).
"""

from __future__ import annotations

import math

from .spec import Prediction

__all__ = ["PREDICTIONS", "capacity", "column_divisor", "dropped", "float_all_to_alls"]

FLOAT32 = 4  # bytes


def float_all_to_alls(calls: list) -> list[dict]:
    """A rank's `all_to_all_single` records that move float32 rows (not the int64 counts), in the order called."""
    return [c for c in calls if c["op"] == "all_to_all_single" and c.get("dtype") == "float32"]


def capacity(factor: float, tokens: int, k: int, experts: int) -> int:
    """Switch's expert capacity: ceil(factor * tokens * k / experts) (token, expert) pairs per expert."""
    return math.ceil(factor * tokens * k / experts)


def dropped(counts: list[int], slots: int) -> int:
    """Pairs an expert of `slots` places cannot take, summed over the experts: sum of max(0, count - slots)."""
    return sum(max(0, c - slots) for c in counts)


def _ep_measured(results, ledgers) -> tuple:
    # Each step: dispatch and combine forward, then their backward in reverse order: 4 float32 all-to-alls.
    step1 = float_all_to_alls(ledgers[0])[4:6]
    return step1[0]["bytes"], step1[1]["bytes"]


def _ep_formula(results) -> tuple:
    run = results["ep2"][0]
    p, row = len(results["ep2"]), run["hidden"] * FLOAT32
    pairs = run["tokens"] * run["k"]                      # each token goes to k experts: k rows
    return pairs * row, p * pairs * row                   # rank 0's experts get every rank's pairs


def _dropped_formula(results) -> int:
    run = results["capacity"][0]
    return dropped(run["counts"], capacity(run["factors"][0], run["tokens"], run["k"], run["experts"]))


def _capacity_bytes_formula(results) -> int:
    run = results["capacity"][0]
    slots = capacity(run["factors"][1], run["tokens"], run["k"], run["experts"])
    return run["experts"] * slots * run["hidden"] * FLOAT32


def column_divisor(summed: list, one_process: list) -> float:
    """The number an expert's gradient summed over its column (`summed`, one tensor per weight) must be divided
    by to equal one process's gradient: the ratio of the norms, to 3 decimals."""
    import torch

    flat = torch.cat([g.flatten() for g in summed])
    return round(float(flat.norm() / torch.cat([g.flatten() for g in one_process]).norm()), 3)


def _divisor_measured(results, ledgers) -> float:
    run = results["epdp"][0]
    return column_divisor(run["summed"], run["one_process"])


def _divisor_formula(results) -> float:
    mesh = results["epdp"][0]["mesh"]
    # The column's sum covers every rank's loss: one process's mean divides it by the world size.
    return float(mesh["dp_mod_ep"] * mesh["ep"])


def _dropped_explanation(results) -> str:
    run = results["capacity"][0]
    slots = capacity(run["factors"][0], run["tokens"], run["k"], run["experts"])
    over = [c for c in run["counts"] if c > slots]
    arithmetic = " + ".join(f"({c} - {slots})" for c in over) or "nothing"
    return (f"capacity = ceil(1.0 x {run['tokens']} tokens x {run['k']} / {run['experts']} experts) = {slots} pairs "
            f"per expert, per rank. Each expert keeps its first {slots} pairs in queue order and drops the rest: the "
            f"sum over experts of max(0, count - {slots}). Rank 0's counts per expert are {run['counts']}: "
            f"{arithmetic} = {dropped(run['counts'], slots)}. A factor of 1.0 has no slack: any expert above the "
            "mean drops, and the places the others leave empty are sent as padding.")


PREDICTIONS: dict[str, Prediction] = {
    "10.ep_bytes": Prediction(
        id="10.ep_bytes",
        question=("expert parallelism on 2 ranks, step 1 (every pair to experts 0 and 1, on rank 0): bytes of rank "
                  "0's dispatch input and of its combine input"),
        needs="ep2",
        measure=_ep_measured,
        formula=_ep_formula,
        explanation=("the dispatch's input holds one row per (token, expert) pair, whatever the routing: 16 tokens "
                     "x top-2 = 32 rows of 8 floats, 32 rows x 32 bytes (8 floats x 4 B) = 1,024 bytes, the piece rank 0 keeps for its own "
                     "experts included (the ledger records the input tensor). The combine sends back what the "
                     "rank's experts computed: here every pair of both ranks, 64 rows, 2,048 bytes, while rank 1's "
                     "combine input is empty. A rank's dispatch is fixed by its tokens; its combine, and its "
                     "experts' work, by what the other ranks' routers chose."),
        unit="B",
    ),
    "10.dropped": Prediction(
        id="10.dropped",
        question="capacity factor 1.0, 4 ranks of 16 tokens, top-2, 8 experts: pairs rank 0 drops",
        needs="capacity",
        measure=lambda results, ledgers: results["capacity"][0]["dropped"][0],
        formula=_dropped_formula,
        explanation=_dropped_explanation,
        unit="pairs",
    ),
    "10.capacity_bytes": Prediction(
        id="10.capacity_bytes",
        question="capacity factor 1.25, 4 ranks of 16 tokens, top-2, 8 experts, hidden 8: bytes of rank 0's dispatch",
        needs="capacity",
        measure=lambda results, ledgers: float_all_to_alls(ledgers[0])[2]["bytes"],
        formula=_capacity_bytes_formula,
        explanation=("with fixed shapes every expert gets exactly capacity rows from every rank, filled or not: "
                     "capacity = ceil(1.25 x 16 x 2 / 8) = 5, so the buffer is 8 experts x 5 rows x 8 floats x 4 "
                     "bytes = 1,280 bytes, whatever the routing: 1.25 times the 1,024 bytes of the 32 pairs, "
                     "and some of the pairs dropped all the same. The capacity factor buys static shapes (no count "
                     "exchange, no host sync) with padding and dropped tokens."),
        unit="B",
    ),
    "10.expert_grad_divisor": Prediction(
        id="10.expert_grad_divisor",
        question=("EP x DP on a 2 x 2 (dp_mod_ep, ep) mesh: the number an expert's gradient, summed over its column, "
                  "must be divided by to equal one process's"),
        needs="epdp",
        measure=_divisor_measured,
        formula=_divisor_formula,
        explanation=("the backward all-to-all already brought each expert the gradients of every row it computed: "
                     "the tokens of both ranks of its row (ep = 2). The all_reduce over its column adds the other "
                     "row's copy, so the sum covers all 4 ranks' losses. One process's loss is the mean over all 64 "
                     "tokens, the mean of the 4 ranks' losses (16 tokens each), so the divisor is the world size, 4, "
                     "as for the dense weights. The column's size, 2 (FSDP2's default mean over the mesh it shards "
                     "a parameter on), would leave an expert's gradient 4 / 2 = ep = 2 times one process's. "
                     "launch/moe.py divides by ep in a hook and lets FSDP2 take the column's mean; transformers 5.24 "
                     "sets the experts' FSDP2 divide factor to the data-parallel size (torchtitan did so in 2025; "
                     "since January 2026 it turns FSDP's division off and divides by the global token count itself)."),
    ),
}
