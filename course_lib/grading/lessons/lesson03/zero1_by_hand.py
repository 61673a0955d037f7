"""03.zero1_by_hand: a ZeRO-1 optimizer written by hand, around any torch.optim class.

The learner writes `ShardedOptimizer(params, optimizer_class, **defaults)` with `step()`,
`zero_grad()` and `optim` (the inner optimizer, over this rank's own parameters). Each rank backpropagates
its rows of every step's batch through a plain model (no DDP). References, in this process: one
process's optimizer on the whole batches (the parameters), and ZeroRedundancyOptimizer's greedy
partition (largest first, to the rank holding the fewest elements) times each parameter's state bytes
(what each rank's `optim.state` must hold). Judges recognise: every rank stepping every parameter (all
the state on every rank), a parameter never sent from its owner (ranks diverge), gradients not
averaged (each owner stepped with its own rows' gradient) or summed, a partition other than greedy (or
greedy over the parameters that train only). The third run's model has a frozen parameter (gradient None,
owned and never stepped) and a weight tied to another layer's (one Parameter, listed once).
"""

from __future__ import annotations

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (ADAM_LR, ATOL, RTOL, _model, greedy_owners, optimizer_reference, shard_cases, state_bytes,
                     whole_batches)

__all__ = ["SHARED", "ZERO1", "ZERO1_DEFAULTS"]

ZERO1_DEFAULTS = {"Adam": {"lr": ADAM_LR}, "SGD": {"lr": 0.1, "momentum": 0.9}}
# The third run's model: Linear(4, 6) -> ReLU -> Linear(6, 6) -> ReLU -> Linear(6, 6) -> ReLU -> Linear(6, 2), its first
# weight frozen and its third layer's weight the second's. On 2 ranks the greedy split gives the frozen 0.weight
# to rank 1 (state: none), and a split of the trainable parameters only would differ.
SHARED = {"layers": ((4, 6), (6, 6), (6, 6), (6, 2)), "frozen": ("0.weight",), "tied": (("4.weight", "2.weight"),)}


def _cases(n: int, specs: list[tuple[int, int, int, int, str]]) -> list[dict[int, tuple]]:
    return shard_cases(n, [(*spec, ZERO1_DEFAULTS[spec[4]]) for spec in specs])


def _shared_cases(n: int, seed: int, steps: int, rows: int) -> list[dict[int, tuple]]:
    """One Adam case on SHARED's model: its weights replace the plain model's, its frozen and tied names ride along."""
    from ..lesson02.ddp_from_scratch import _weights

    (case,) = shard_cases(n, [(seed, steps, rows, seed + 100)])
    weights = _weights(seed, SHARED["layers"])
    return [{r: (weights, pairs, "Adam", ZERO1_DEFAULTS["Adam"], list(SHARED["frozen"]),
                 [list(pair) for pair in SHARED["tied"]]) for r, (_, pairs) in case.items()}]


def _shape_of(outcome: RunOutcome, case: int) -> tuple:
    """(frozen, tied) of a case's model: empty for the plain one."""
    args = outcome.inputs[case][0]
    return (tuple(args[4]), tuple(map(tuple, args[5]))) if len(args) > 4 else ((), ())


def _built(outcome: RunOutcome, case: int):
    """The case's model, built in this process from rank 0's weights (frozen and tied as the ranks build it)."""
    return _model(outcome.inputs[case][0][0], *_shape_of(outcome, case))


def _label(outcome: RunOutcome, case: int) -> str:
    _, steps, name, defaults = outcome.inputs[case][0][:4]
    options = ", ".join(f"{k}={v:g}" for k, v in defaults.items())
    frozen, tied = _shape_of(outcome, case)
    shape = "".join([f", {n} frozen" for n in frozen] + [f", {n} tied to {source}" for n, source in tied])
    return (f"case {case + 1} of {len(outcome.inputs)} (torch.optim.{name}({options}), {len(steps)} steps, "
            f"{steps[0][0].shape[0]} rows per rank per step{shape})")


def _problem(outcome: RunOutcome, case: int) -> str:
    for rank, result in sorted(outcome.results[case].items()):
        if result.output.get("problem"):
            return f"rank {rank}, {_label(outcome, case)}: {result.output['problem']}"
    return ""


def _owners(outcome: RunOutcome, case: int) -> list[int]:
    """Who stepped each parameter, as the ranks' inner optimizers say (greedy where they disagree)."""
    owner = greedy_owners([p.numel() for p in _built(outcome, case).parameters()], outcome.nproc)
    for rank, result in sorted(outcome.results[case].items()):
        for index in result.output.get("owned") or []:
            owner[index] = rank
    return owner


def _simulated(outcome: RunOutcome, case: int, gradient: str, owner: list[int]) -> dict:
    """Parameters after the steps, in one process, when parameter i steps with `gradient` of the ranks'
    gradients: "sum" over the ranks, or "owner": its owner's rows only (nothing averaged)."""
    import torch

    _, _, name, defaults = outcome.inputs[case][0][:4]
    model = _built(outcome, case)
    optimizer = getattr(torch.optim, name)(model.parameters(), **defaults)
    shards = [outcome.inputs[case][r][1] for r in range(outcome.nproc)]
    for k in range(len(shards[0])):
        grads = []
        for shard in shards:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(shard[k][0]), shard[k][1]).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            if p.requires_grad:
                p.grad = sum(g[i] for g in grads) if gradient == "sum" else grads[owner[i]][i]
        optimizer.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _close(got, expected) -> bool:
    return not first_difference(got, expected, rtol=RTOL, atol=ATOL)


def _params_equal(optimizer_name: str):
    def judge(outcome: RunOutcome) -> list[str]:
        """Every rank's parameters equal one process's optimizer on the whole batches."""
        for case, by_rank in enumerate(outcome.results):
            weights, _, name, defaults = outcome.inputs[case][0][:4]
            if name != optimizer_name:
                continue
            if (problem := _problem(outcome, case)):
                return [problem]
            batches = whole_batches(outcome, case)
            initial = {k: v.detach().clone() for k, v in _built(outcome, case).named_parameters()}
            model, _ = optimizer_reference(weights, batches, name, defaults, model=_built(outcome, case))
            expected = {k: v.detach() for k, v in model.named_parameters()}
            names = list(expected)
            owner = _owners(outcome, case)
            for rank in range(outcome.nproc):  # a parameter never received from its owner
                got = by_rank[rank].output["params"]
                for index, pname in enumerate(names):
                    if (rank != owner[index] and not first_difference(got[pname], initial[pname])
                            and first_difference(got[pname], expected[pname], rtol=RTOL, atol=ATOL)):
                        return [f"rank {rank}, {_label(outcome, case)}: {pname} still holds its initial value; "
                                f"rank {owner[index]} stepped it and this rank never received the result: after the "
                                "step every parameter must go from its owner to every other rank"]
            for rank in range(outcome.nproc):
                got = by_rank[rank].output["params"]
                for pname in names:
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
    for case, rank, result in each_result(outcome):
        if (problem := _problem(outcome, case)):
            return [problem]
        weights, _, name, defaults = outcome.inputs[case][0][:4]
        model, reference = optimizer_reference(weights, whole_batches(outcome, case), name, defaults,
                                               model=_built(outcome, case))
        names = [n for n, _ in model.named_parameters()]
        params = list(model.parameters())
        per_param = [state_bytes(reference.state[p]) if p in reference.state else 0 for p in params]
        owner = greedy_owners([p.numel() for p in params], outcome.nproc)
        got = result.output["state_bytes"]
        mine = [names[i] for i in range(len(names)) if owner[i] == rank]
        expected = sum(per_param[i] for i in range(len(names)) if owner[i] == rank)
        if got == expected:
            continue
        where = f"rank {rank}, {_label(outcome, case)}"
        held = [names[i] for i in result.output.get("owned") or []]
        why = (f"the greedy split (largest first, each to the rank holding the fewest elements so far, the "
               f"lowest rank on a tie) gives rank {rank} {', '.join(mine)}: {expected:,} B")
        if got == sum(per_param):
            return [f"{where}: optim.state holds {got:,} B, the state of every parameter: every rank steps "
                    f"everything, nothing is sharded; {why}"]
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        if len(trainable) < len(params):
            split = greedy_owners([params[i].numel() for i in trainable], outcome.nproc)
            if got == sum(per_param[i] for i, o in zip(trainable, split) if o == rank):
                return [f"{where}: optim.state holds {got:,} B, the greedy split of the parameters that require a "
                        f"gradient only; split every parameter given, frozen ones included, as "
                        f"ZeroRedundancyOptimizer does (a frozen one is owned, never stepped): {why}"]
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
        RunSpec(2, lambda n: _shared_cases(n, 38, 3, 4),
                (Item("with a frozen and a tied parameter: parameters equal one process's Adam after 3 steps (2 ranks)",
                      1, _params_equal("Adam")),
                 Item("with a frozen and a tied parameter: each rank's optimizer state is its greedy share (2 ranks)",
                      1, _sharded_state)),
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
