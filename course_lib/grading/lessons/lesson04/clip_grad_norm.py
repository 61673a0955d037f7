"""04.clip_grad_norm: clipping by the whole model's norm when each rank holds a shard of the gradients."""

from __future__ import annotations

import math

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, FSDP1_OPS, FSDP_PRELOAD, LR, RTOL, TOY, compare_params, draw_batch, draw_weights, toy

__all__ = ["CLIP", "clip_reference"]

def _toy_case(n: int, weights_seed: int, rows: int, batch_seed: int, extra) -> dict[int, tuple]:
    from ....models import ToyModel

    weights = draw_weights(lambda: ToyModel(**TOY), weights_seed)
    inputs, targets = draw_batch(n * rows, TOY["dim"], TOY["out"], batch_seed)
    return {r: (TOY, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], extra, LR)
            for r in range(n)}


def _whole(outcome: RunOutcome, case: int) -> tuple:
    import torch

    return (torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)]),
            torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)]))


def clip_reference(weights: dict, inputs, targets, max_norm: float, lr: float | None = None) -> tuple:
    """(the gradients' total norm, {name: gradient clipped to max_norm}) of ToyModel on the whole batch, one
    process; with `lr`, also {name: parameter} after one SGD(lr) step with those gradients."""
    import torch

    model = toy(weights)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if lr is None:
        return float(norm), grads
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return float(norm), grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _clip_label(outcome: RunOutcome, case: int) -> str:
    inputs, _ = _whole(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} (max_norm={outcome.inputs[case][0][4]:g}, batch of "
            f"{inputs.shape[0]} split over {outcome.nproc} ranks)")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


def _norm_judge(outcome: RunOutcome) -> list[str]:
    """clip returns the total norm of all gradients (every rank's shards together) on every rank."""
    for case, by_rank in enumerate(outcome.results):
        weights, max_norm = outcome.inputs[case][0][1], outcome.inputs[case][0][4]
        expected, _ = clip_reference(weights, *_whole(outcome, case), max_norm)
        local = {rank: result.output["local_norm"] for rank, result in by_rank.items()}
        for rank, result in sorted(by_rank.items()):
            got = result.output["norm"]
            where = f"rank {rank}, {_clip_label(outcome, case)}"
            if not isinstance(got, float):
                return [f"{where}: clip returned a {got}, expected the total norm (a number or a one-element tensor)"]
            if _close(got, expected):
                continue
            hint = ""
            agreed = all(isinstance(r.output["norm"], float) and _close(r.output["norm"], got) for r in by_rank.values())
            if agreed and _close(got, max(local.values())):
                hint = (": that is the largest of the ranks' shard norms (an all-reduce with MAX); the whole "
                        "norm adds every rank's squares")
            elif _close(got, local[rank]):
                hint = (": that is the norm of this rank's shard only (model.parameters() yields this rank's "
                        "FlatParameter shards); the whole norm covers every rank's shard")
            elif _close(got, sum(local.values())):
                hint = (": that is the sum of the ranks' shard norms; norms do not add: their squares "
                        "do")
            elif _close(got, expected ** 2):
                hint = ": that is the square of the norm"
            return [f"{where}: the norm is {got:.6g}, expected {expected:.6g} (all gradients, every rank's shard)"
                    f"{hint}"]
    return []


def _grads_judge(outcome: RunOutcome) -> list[str]:
    """Each rank's shard of every FlatParameter's gradient equals its slice of one process's clipped gradients."""
    for case, by_rank in enumerate(outcome.results):
        weights, max_norm = outcome.inputs[case][0][1], outcome.inputs[case][0][4]
        norm, expected = clip_reference(weights, *_whole(outcome, case), max_norm)
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_clip_label(outcome, case)}"
            for flat in result.output["flats"]:
                grad = flat["grad"]
                if grad is None:
                    return [f"{where}: {flat['name']} has no gradient afterwards"]
                starts = {name: start for name, start, _ in flat["layout"] if name is not None}
                for name, first, last in flat["pieces"]:
                    at = starts[name] + first - flat["shard_start"]
                    want = expected[name].flatten()[first:last]
                    wrong = first_difference(grad[at:at + last - first], want, rtol=RTOL, atol=ATOL)
                    if wrong:
                        hint = ""
                        if norm <= max_norm:
                            hint = (f": the norm {norm:.6g} is below max_norm={max_norm:g}, so the gradients must "
                                    "stay as they are (the factor is at most 1)")
                        elif not (isinstance(result.output["norm"], float) and _close(result.output["norm"], norm)):
                            hint = (f": clipped by another norm than the total, {norm:.6g} (each rank must scale "
                                    f"by max_norm / total norm)")
                        return [f"{where}: this rank's shard of {name}'s gradient (elements {first} to {last - 1}) "
                                f"{wrong}{hint}"]
    return []


def _step_judge(outcome: RunOutcome) -> list[str]:
    """An SGD step after clip gives one process's parameters after clipping and the same step."""
    for case, by_rank in enumerate(outcome.results):
        weights, max_norm, lr = (outcome.inputs[case][0][i] for i in (1, 4, 5))
        _, _, expected = clip_reference(weights, *_whole(outcome, case), max_norm, lr)
        for rank, result in sorted(by_rank.items()):
            wrong = compare_params(result.output["params"], expected,
                                   f"rank {rank}, {_clip_label(outcome, case)}, after clipping and an SGD step (lr {lr:g})")
            if wrong:
                return [wrong]
    return []


CLIP = Exercise(
    id="04.clip_grad_norm",
    function="clip",
    signature="clip(model: FullyShardedDataParallel, max_norm: float) -> torch.Tensor",
    driver="fsdp_clip",
    allowed_ops=FSDP1_OPS | {"all_reduce"},
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_toy_case(n, 43, 4, 143, 0.5), _toy_case(n, 48, 4, 148, 50.0)],
                (Item("returns the total gradient norm on every rank (2 ranks, clipped and not)", 1, _norm_judge),
                 Item("every rank's gradient shards are clipped by it (2 ranks, clipped and not)", 1, _grads_judge),
                 Item("an SGD step then gives one process's parameters (2 ranks)", 1, _step_judge)), timeout_s=10),
        RunSpec(3, lambda n: [_toy_case(n, 44, 2, 144, 0.3), _toy_case(n, 45, 2, 145, 100.0)],
                (Item("returns the total gradient norm on every rank (3 ranks, clipped and not)", 1, _norm_judge),
                 Item("every rank's gradient shards are clipped by it (3 ranks, clipped and not)", 1,
                      _grads_judge),
                 Item("an SGD step then gives one process's parameters (3 ranks)", 1, _step_judge)), timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 10 'Accumulation with no_sync, and clipping' (what each rank's norm is, and how"
        " the ranks' norms make the whole one).",
        "torch.linalg.vector_norm (or Tensor.square and sum) on each local gradient, torch.distributed.all_reduce"
        " with its default op, and Tensor.mul_.",
        "The squares of all the model's gradient elements are spread over the ranks, each element on exactly one"
        " (the padding is zero): each rank adds up its own, one collective adds the ranks' totals, and the square"
        " root is the norm every rank then knows. Every rank scales its own gradient pieces in place by the same"
        " factor, which is never above 1.",
    ),
)
