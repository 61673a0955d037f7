"""03.zero1_by_hand: a ZeRO-1 optimizer written by hand, around any torch.optim class.

The learner writes `ShardedOptimizer(params, optimizer_class, **defaults)` with `step()`,
`zero_grad()` and `optim` (the inner optimizer, over this rank's own parameters). Each rank backpropagates
its rows of every step's batch through a plain model (no DDP). References, in this process: one
process's optimizer on the whole batches (the parameters), and ZeroRedundancyOptimizer's greedy
partition (largest first, to the rank holding the fewest elements) times each parameter's state bytes
(what each rank's `optim.state` must hold). Judges recognise: every rank stepping every parameter (all
the state on every rank), a parameter never sent from its owner (ranks diverge), gradients not
averaged (each owner stepped with its own rows' gradient) or summed, a partition other than greedy.
"""

from __future__ import annotations

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (ADAM_LR, ATOL, NAMES, RTOL, _model, greedy_owners, optimizer_reference, shard_cases, state_bytes,
                     whole_batches)

__all__ = ["ZERO1", "ZERO1_DEFAULTS"]

ZERO1_DEFAULTS = {"Adam": {"lr": ADAM_LR}, "SGD": {"lr": 0.1, "momentum": 0.9}}


def _cases(n: int, specs: list[tuple[int, int, int, int, str]]) -> list[dict[int, tuple]]:
    return shard_cases(n, [(*spec, ZERO1_DEFAULTS[spec[4]]) for spec in specs])


def _label(outcome: RunOutcome, case: int) -> str:
    _, steps, name, defaults = outcome.inputs[case][0]
    options = ", ".join(f"{k}={v:g}" for k, v in defaults.items())
    return (f"case {case + 1} of {len(outcome.inputs)} (torch.optim.{name}({options}), {len(steps)} steps, "
            f"{steps[0][0].shape[0]} rows per rank per step)")


def _problem(outcome: RunOutcome, case: int) -> str:
    for rank, result in sorted(outcome.results[case].items()):
        if result.output.get("problem"):
            return f"rank {rank}, {_label(outcome, case)}: {result.output['problem']}"
    return ""


def _owners(outcome: RunOutcome, case: int) -> list[int]:
    """Who stepped each parameter, as the ranks' inner optimizers say (greedy where they disagree)."""
    weights = outcome.inputs[case][0][0]
    owner = greedy_owners([w.numel() for w in weights], outcome.nproc)
    for rank, result in sorted(outcome.results[case].items()):
        for index in result.output.get("owned") or []:
            owner[index] = rank
    return owner


def _simulated(outcome: RunOutcome, case: int, gradient: str, owner: list[int]) -> dict:
    """Parameters after the steps, in one process, when parameter i steps with `gradient` of the ranks'
    gradients: "sum" over the ranks, or "owner": its owner's rows only (nothing averaged)."""
    import torch

    weights, _, name, defaults = outcome.inputs[case][0]
    model = _model(weights)
    optimizer = getattr(torch.optim, name)(model.parameters(), **defaults)
    shards = [outcome.inputs[case][r][1] for r in range(outcome.nproc)]
    for k in range(len(shards[0])):
        grads = []
        for shard in shards:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(shard[k][0]), shard[k][1]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) if gradient == "sum" else grads[owner[i]][i]
        optimizer.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _close(got, expected) -> bool:
    return not first_difference(got, expected, rtol=RTOL, atol=ATOL)


def _params_equal(optimizer_name: str):
    def judge(outcome: RunOutcome) -> list[str]:
        """Every rank's parameters equal one process's optimizer on the whole batches."""
        for case, by_rank in enumerate(outcome.results):
            weights, _, name, defaults = outcome.inputs[case][0]
            if name != optimizer_name:
                continue
            if (problem := _problem(outcome, case)):
                return [problem]
            batches = whole_batches(outcome, case)
            model, _ = optimizer_reference(weights, batches, name, defaults)
            expected = {k: v.detach() for k, v in model.named_parameters()}
            owner = _owners(outcome, case)
            for rank in range(outcome.nproc):  # a parameter never received from its owner
                got = by_rank[rank].output["params"]
                for index, pname in enumerate(NAMES):
                    if (rank != owner[index] and not first_difference(got[pname], weights[index])
                            and first_difference(got[pname], expected[pname], rtol=RTOL, atol=ATOL)):
                        return [f"rank {rank}, {_label(outcome, case)}: {pname} still holds its initial value; "
                                f"rank {owner[index]} stepped it and this rank never received the result: after the "
                                "step every parameter must go from its owner to every other rank"]
            for rank in range(outcome.nproc):
                got = by_rank[rank].output["params"]
                for pname in NAMES:
                    wrong = first_difference(got[pname], expected[pname], rtol=RTOL, atol=ATOL)
                    if not wrong:
                        continue
                    where = f"rank {rank}, {_label(outcome, case)}: {pname} {wrong}"
                    if _close(got[pname], _simulated(outcome, case, "owner", owner)[pname]):
                        return [f"{where}: that is each owner's step with the gradient of its own rows only; "
                                "average the gradients over the ranks before stepping"]
                    if _close(got[pname], _simulated(outcome, case, "sum", owner)[pname]):
                        return [f"{where}: that is a step with the sum of the {outcome.nproc} ranks' gradients; "
                                "average them (divide by the world size)"]
                    return [where]
        return []

    judge.__doc__ = f"Every rank's parameters equal one process's torch.optim.{optimizer_name} on the whole batches."
    return judge


def _sharded_state(outcome: RunOutcome) -> list[str]:
    """Each rank's optim.state holds the bytes of its greedy share: the state of its own parameters only."""
    for case, by_rank in enumerate(outcome.results):
        if (problem := _problem(outcome, case)):
            return [problem]
        weights, _, name, defaults = outcome.inputs[case][0]
        _, reference = optimizer_reference(weights, whole_batches(outcome, case), name, defaults)
        per_param = [state_bytes(reference.state[p]) for group in reference.param_groups for p in group["params"]]
        owner = greedy_owners([w.numel() for w in weights], outcome.nproc)
        for rank in range(outcome.nproc):
            got = by_rank[rank].output["state_bytes"]
            mine = [NAMES[i] for i in range(len(NAMES)) if owner[i] == rank]
            expected = sum(per_param[i] for i in range(len(NAMES)) if owner[i] == rank)
            if got == expected:
                continue
            where = f"rank {rank}, {_label(outcome, case)}"
            held = [NAMES[i] for i in by_rank[rank].output.get("owned") or []]
            why = (f"the greedy split (largest first, each to the rank holding the fewest elements so far, the "
                   f"lowest rank on a tie) gives rank {rank} {', '.join(mine)}: {expected:,} B")
            if got == sum(per_param):
                return [f"{where}: optim.state holds {got:,} B, the state of every parameter: every rank steps "
                        f"everything, nothing is sharded; {why}"]
            return [f"{where}: optim.state holds {got:,} B (the state of {', '.join(held) or 'no parameter'}); {why}"]
    return []


ZERO1 = Exercise(
    id="03.zero1_by_hand",
    function="ShardedOptimizer",
    signature="class ShardedOptimizer(params, optimizer_class, **defaults): step() -> None, zero_grad() -> None, optim",
    driver="zero1_by_hand",
    allowed_ops=frozenset({"all_reduce", "broadcast"}),
    runs=(
        RunSpec(2, lambda n: _cases(n, [(35, 3, 4, 135, "Adam"), (36, 3, 4, 136, "SGD")]),
                (Item("parameters equal one process's Adam after 3 steps, on every rank (2 ranks)", 1,
                      _params_equal("Adam")),
                 Item("parameters equal one process's SGD with momentum after 3 steps (2 ranks)", 1,
                      _params_equal("SGD")),
                 Item("each rank's optimizer state is its greedy share, in bytes (2 ranks)", 1, _sharded_state)),
                timeout_s=15),
        RunSpec(3, lambda n: _cases(n, [(37, 3, 2, 137, "Adam")]),
                (Item("parameters equal one process's Adam after 3 steps, on every rank (3 ranks)", 1,
                      _params_equal("Adam")),
                 Item("each rank's optimizer state is its greedy share, in bytes (3 ranks)", 1, _sharded_state)),
                timeout_s=15),
    ),
    hints=(
        "Reread lesson 03, section 6 'ZeroRedundancyOptimizer: the optimizer's state, sharded' (which rank owns "
        "which parameter, and what one step sends), and lesson 01's all-reduce and broadcast.",
        "dist.all_reduce(tensor) (then divide by dist.get_world_size()), dist.broadcast(tensor, src=owner), "
        "optimizer_class(list_of_params, **defaults), Tensor.numel().",
        "At construction, give every parameter an owner the same way on every rank (sort by size, largest first; "
        "each goes to the rank holding the fewest elements so far) and build the inner optimizer over the ones "
        "this rank owns. In step: average every gradient over the ranks, let the inner optimizer update this "
        "rank's parameters, then have each parameter's owner send its new value to the others, in the same order "
        "on every rank.",
    ),
)
