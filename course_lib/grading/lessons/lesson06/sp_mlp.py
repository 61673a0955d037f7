"""06.sp_mlp: sequence parallelism's operators by hand around Megatron's MLP.

Each rank holds its rows of the sequence; the MLP's input is all-gathered (backward: reduce-scattered), its
row-parallel output reduce-scattered (backward: all-gathered), and down's bias, added to this rank's rows after
the reduce-scatter, takes its whole gradient from the gradient that backward's all-gather brought (no collective
of its own: the lesson's f, an all-reduce, is not needed). Judged against one
process: the output rows, the rows' gradient, each parameter's gradient; from the ledger, which collective
ran in forward and in backward, in order. The usual mistakes are named: an all-reduce in place of the
reduce-scatter, the all-gather's backward that only slices, the bias gradient left a term, the bias added
before the reduce-scatter, the bias gradient all-reduced.
"""

from __future__ import annotations

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (ATOL, MLP_DIM, MLP_HIDDEN, RTOL, draw_batch, flows, judge_each, mlp_weights, not_a_module,
                     where)

__all__ = ["SP_MLP"]

ROWS = 8  # the sequence: 4 rows per rank on 2 ranks, 2 on 4
ALLOWED = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                     "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce"})

HINTS = (
    "Reread lesson 06, section 4 'Sequence parallelism' (the SP block, and what backward mirrors) and section 3's "
    "f and g, which you now write for other collectives.",
    "torch.autograd.Function (a forward may take two tensors and backward return two gradients), "
    "dist.all_gather_into_tensor and dist.reduce_scatter_tensor.",
    "One function gathers the ranks' rows going forward and, coming back, keeps only this rank's rows of the "
    "summed gradient; one sums the ranks' terms and keeps this rank's rows going forward and gathers the rows' "
    "gradient coming back. down's bias is added after the sum, to this rank's rows; its gradient is the sum over "
    "every row of the sequence, which the gathered gradient already holds on every rank.",
)


def _case(n: int, seed: int) -> dict[int, tuple]:
    weights = mlp_weights(seed)
    sequence, _ = draw_batch(ROWS, MLP_DIM, 1, seed + 100)
    rows = ROWS // n
    return {r: (weights, sequence[r * rows:(r + 1) * rows]) for r in range(n)}


def _reference(outcome: RunOutcome, case: int) -> dict:
    import torch

    from .drivers import mlp_from_weights

    inputs = outcome.inputs[case]
    mlp = mlp_from_weights(inputs[0][0])
    x = torch.cat([inputs[r][1] for r in sorted(inputs)]).requires_grad_()
    out = mlp(x)
    out.sum().backward()
    return {"out": out.detach(), "x.grad": x.grad, **{n: p.grad for n, p in mlp.named_parameters()}}


def _mine(rank: int, n: int) -> tuple[slice, slice]:
    """This rank's rows of the sequence and its hidden units."""
    rows, h = ROWS // n, MLP_HIDDEN // n
    return slice(rank * rows, (rank + 1) * rows), slice(rank * h, (rank + 1) * h)


@judge_each(before=not_a_module)
def _held(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    h = MLP_HIDDEN // outcome.nproc
    expected = {"up_weight": [h, MLP_DIM], "up_bias": [h], "down_weight": [MLP_DIM, h], "down_bias": [MLP_DIM]}
    got = result.output["params"]
    if got != expected:
        shown = ", ".join(f"{k} {v}" for k, v in got.items()) or "none"
        return [f"{where(rank, case, outcome)}: SPMLP holds the parameters {shown}; expected exactly "
                + ", ".join(f"{k} {v}" for k, v in expected.items())
                + f": this rank's {h} of the {MLP_HIDDEN} hidden units (up's rows, down's columns) and down's "
                "whole bias"]
    return []


@judge_each(before=_held)
def _output(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    import torch

    rows, _ = _mine(rank, outcome.nproc)
    want = _reference(outcome, case)["out"][rows]
    wrong = first_difference(result.output["out"], want, rtol=RTOL, atol=ATOL)
    if wrong:
        hint = ""
        got, n = result.output["out"], outcome.nproc
        bias = outcome.inputs[case][rank][0]["2.bias"]
        if list(got.shape) == [ROWS, MLP_DIM]:
            hint = ": that is the whole sequence; return this rank's rows only (the reduce-scatter keeps them)"
        elif got.shape == want.shape and torch.allclose(got - want, (n - 1) * bias.expand_as(want), rtol=1e-4,
                                                        atol=1e-5):
            hint = (f": down's bias is in it {n} times: every rank added it to its terms before the "
                    "reduce-scatter, which sums the ranks' terms; add it once, to this rank's rows after")
        return [f"{where(rank, case, outcome)}: the output (this rank's rows {rows.start} to {rows.stop - 1}) "
                f"{wrong}{hint}"]
    return []


@judge_each(before=_held)
def _grads(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    import torch

    n = outcome.nproc
    ref, (rows, units) = _reference(outcome, case), _mine(rank, n)
    at = where(rank, case, outcome)
    wrong = first_difference(result.output["x.grad"], ref["x.grad"][rows], rtol=RTOL, atol=ATOL,
                             what=f"the input rows on rank {rank}")
    if wrong:
        hint = ""
        if result.output["x.grad"] is not None and "reduce_scatter" not in flows(result, result.output["backward"]):
            hint = (": backward reduce-scattered nothing: every rank's hidden units used these rows, so their "
                    "gradient is the sum of the ranks' terms; the all-gather's backward reduce-scatters")
        return [f"{at}: the gradient of the input rows {wrong}{hint}"]
    parts = {"up_weight": ("0.weight", (units,)), "up_bias": ("0.bias", (units,)),
             "down_weight": ("2.weight", (slice(None), units)), "down_bias": ("2.bias", ())}
    for name, (full, index) in parts.items():
        got = result.output["grads"].get(name)
        wrong = first_difference(got, ref[full][index], rtol=RTOL, atol=ATOL, what=f"{name} on rank {rank}")
        if wrong:
            hint = ""
            if name == "down_bias" and got is not None and torch.allclose(got, n * ref[full], rtol=RTOL,
                                                                          atol=ATOL):
                hint = (f": {n} times too large: the bias went into the terms before the reduce-scatter, whose "
                        "backward already hands every rank every row's gradient; add it once, after")
            elif name == "down_bias" and got is not None and torch.allclose(got, ref[full] / n, rtol=RTOL,
                                                                            atol=ATOL):
                # Backward of out.sum(): every row's gradient is the same, so this rank's rows give 1/n of it.
                hint = (": that is the gradient of this rank's rows only; the bias is added to every row of the "
                        "sequence (each on its rank), so its gradient sums every row's")
            return [f"{at}: the gradient of {name} (this rank's part of {full}) {wrong}{hint}"]
    return []


@judge_each(before=_held)
def _ledger(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    forward, backward = (flows(result, result.output[phase]) for phase in ("forward", "backward"))
    at = where(rank, case, outcome)
    if forward != ["all_gather", "reduce_scatter"]:
        why = ""
        if "all_reduce" in forward:
            why = (": an all-reduce in forward sums the whole sequence on every rank; SP's exit is a "
                   "reduce-scatter, so that each rank receives the sum of its own rows only")
        return [f"{at}: forward called {forward or 'nothing'}, expected exactly ['all_gather', "
                f"'reduce_scatter']: the rows gathered before up, the row-parallel terms reduce-scattered after "
                f"down{why}"]
    if backward != ["all_gather", "reduce_scatter"]:
        why = ""
        if "all_reduce" in backward:
            why = (": an all-reduce is one collective too many: every rank already holds every row's gradient "
                   "after the all-gather, the bias's gradient among them")
        return [f"{at}: backward called {backward or 'nothing'}, expected exactly the mirror of forward: an "
                "all-gather of the output rows' gradient (the reduce-scatter's backward), then a reduce-scatter "
                f"of the input's gradient (the all-gather's backward), nothing else{why}"]
    return []


SP_MLP = Exercise(
    id="06.sp_mlp",
    hints=HINTS,
    function="SPMLP",
    signature="SPMLP(up: nn.Linear, down: nn.Linear) -> nn.Module",
    driver="sp_mlp",
    allowed_ops=ALLOWED,
    runs=tuple(
        RunSpec(n, (lambda n, s=seed: [_case(n, s)]),
                (Item(f"output rows equal one process ({n} ranks)", 1, _output),
                 Item(f"gradients of the rows and of each shard equal one process ({n} ranks)", 1, _grads),
                 Item(f"all-gather then reduce-scatter in forward, mirrored in backward, nothing else ({n} ranks)",
                      1, _ledger)),
                timeout_s=15)
        for n, seed in ((2, 61), (4, 62))),
)
