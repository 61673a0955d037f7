"""03.zero_consolidate_save: save ZeroRedundancyOptimizer's sharded Adam state as one file, then resume from it.

The checker trains DDP + ZeroRedundancyOptimizer(Adam) for some steps (each rank its rows of each
step's batch), calls the learner's `save_optimizer(optimizer, path)` on every rank, waits for every rank,
builds a new ZeroRedundancyOptimizer over the same (trained) parameters, calls `load_optimizer(new, path)`
on every rank and trains the remaining steps. References, in this process: a plain Adam loads rank 0's
file and its state equals one process's Adam on the whole batches; the parameters after resuming equal
one process's Adam over all the steps. Judges recognise: rank 0's shard saved instead of the whole
state, the state loaded on rank 0 only (the others resume their share from scratch), nothing loaded.
"""

from __future__ import annotations

import io

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (ADAM_LR, ATOL, NAMES, RTOL, STATE_ATOL, STATE_RTOL, ZERO_PRELOAD, _model, greedy_owners,
                     optimizer_reference, shard_cases, whole_batches)

__all__ = ["ZERO_SAVE"]


def _cases(n: int, specs: list[tuple[int, int, int, int, int]]) -> list[dict[int, tuple]]:
    """(weights seed, steps, rows per rank, batch seed, steps before the save) per case."""
    return shard_cases(n, [(*spec, ADAM_LR, f"optimizer_case{i + 1}.pt") for i, spec in enumerate(specs)])


def _label(outcome: RunOutcome, case: int) -> str:
    _, steps, saved_after, _, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} ({saved_after} Adam steps, saved, {len(steps) - saved_after} "
            f"more after loading; {steps[0][0].shape[0]} rows per rank per step)")


def _loaded(outcome: RunOutcome, case: int):
    """(a plain Adam over the model that loaded rank 0's file, "") or (None, what went wrong)."""
    import torch

    weights, _, _, lr, _ = outcome.inputs[case][0]
    where = f"rank 0, {_label(outcome, case)}"
    saved = outcome.results[case][0].output["saved"]
    if saved is None:
        return None, (f"{where}: no file at the path given after save_optimizer returned on rank 0; rank 0 must "
                      "write it there")
    try:
        state = torch.load(io.BytesIO(saved.numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - not a file torch.save wrote, or not plain data
        return None, f"{where}: torch.load could not read the file ({type(exc).__name__}: {exc})"
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        return None, f"{where}: the file holds {keys}, not an optimizer's state_dict (keys 'state', 'param_groups')"
    held = sum(len(group.get("params", [])) for group in state["param_groups"])
    if held != len(NAMES):
        return None, (f"{where}: the file holds the state of {held} of the model's {len(NAMES)} parameters: one "
                      "rank's shard; the file must hold the state of every parameter, gathered from every rank")
    optimizer = torch.optim.Adam(_model(weights).parameters(), lr=lr)
    try:
        optimizer.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001 - a state_dict of another shape
        return None, f"{where}: a plain torch.optim.Adam could not load it ({type(exc).__name__}: {exc})"
    return optimizer, ""


def _loads(outcome: RunOutcome) -> list[str]:
    """Rank 0's file loads into a plain torch.optim.Adam over the same model (load_state_dict)."""
    for case in range(len(outcome.results)):
        optimizer, problem = _loaded(outcome, case)
        if optimizer is None:
            return [problem]
    return []


def _state_equal(outcome: RunOutcome) -> list[str]:
    """step, exp_avg and exp_avg_sq of every parameter equal one process's Adam on the whole batches."""
    for case in range(len(outcome.results)):
        optimizer, problem = _loaded(outcome, case)
        if optimizer is None:
            return [problem]
        weights, _, saved_after, lr, _ = outcome.inputs[case][0]
        _, reference = optimizer_reference(weights, whole_batches(outcome, case)[:saved_after], "Adam", {"lr": lr})
        got_params = [p for group in optimizer.param_groups for p in group["params"]]
        want_params = [p for group in reference.param_groups for p in group["params"]]
        for name, got_p, want_p in zip(NAMES, got_params, want_params):
            got, want = optimizer.state.get(got_p, {}), reference.state[want_p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in got:
                    return [f"rank 0, {_label(outcome, case)}: no {key} for {name} in the saved state"]
                wrong = first_difference(got[key].float(), want[key].float(), rtol=STATE_RTOL, atol=STATE_ATOL)
                if wrong:
                    return [f"rank 0, {_label(outcome, case)}: {name}'s {key} {wrong}"]
    return []


def _resumed_reference(outcome: RunOutcome, case: int, fresh_ranks: set[int]) -> dict:
    """Parameters after all steps, one process, the Adam state of the parameters owned by `fresh_ranks`
    dropped at the save (those ranks resumed their share from scratch)."""
    weights, _, saved_after, lr, _ = outcome.inputs[case][0]
    batches = whole_batches(outcome, case)
    model, optimizer = optimizer_reference(weights, batches[:saved_after], "Adam", {"lr": lr})
    owner = greedy_owners([w.numel() for w in weights], outcome.nproc)
    for index, p in enumerate(model.parameters()):
        if owner[index] in fresh_ranks:
            optimizer.state.pop(p, None)  # Adam starts a parameter with no state from zero moments, step 0
    model, _ = optimizer_reference(weights, batches[saved_after:], model=model, optimizer=optimizer)
    return {k: v.detach() for k, v in model.named_parameters()}


def _resumed(outcome: RunOutcome) -> list[str]:
    """After load_optimizer on every rank, the remaining steps give one process's Adam over all the steps."""
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        for rank in range(n):
            error = by_rank[rank].output.get("load_error")
            if error:
                hint = ""
                if "doesn't match the size of optimizer's group" in error:
                    hint = (": the optimizer it loads into holds fewer parameters than the file (the inner optimizer "
                            "holds only this rank's share?) or the file holds fewer than the model (one shard?)")
                return [f"rank {rank}, {_label(outcome, case)}: load_optimizer raised {error}{hint}"]
        expected = _resumed_reference(outcome, case, set())
        for rank in range(n):
            got = by_rank[rank].output["params"]
            for name in NAMES:
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                where = f"rank {rank}, {_label(outcome, case)}: after resuming, {name} {wrong}"
                if not first_difference(got[name], _resumed_reference(outcome, case, set(range(n)))[name],
                                        rtol=RTOL, atol=ATOL):
                    return [f"{where}: that is Adam resumed with no state at all (the moments and step count start "
                            "again from zero); the new optimizer must continue from the file"]
                if not first_difference(got[name], _resumed_reference(outcome, case, set(range(1, n)))[name],
                                        rtol=RTOL, atol=ATOL):
                    return [f"{where}: that is the state loaded on rank 0 only: the parameters ranks 1 to {n - 1} own "
                            "resumed their Adam state from zero; each rank keeps the state of its own share, so every "
                            "rank loads the file"]
                return [where]
    return []


ZERO_SAVE = Exercise(
    id="03.zero_consolidate_save",
    function="save_optimizer",
    signature=("save_optimizer(optimizer: ZeroRedundancyOptimizer, path: str) -> None; "
               "load_optimizer(optimizer: ZeroRedundancyOptimizer, path: str) -> None"),
    driver="zero_save",
    allowed_ops=frozenset({"all_reduce", "broadcast"}),
    preload=ZERO_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _cases(n, [(33, 5, 4, 133, 3)]),
                (Item("rank 0's file loads into a plain torch.optim.Adam (2 ranks)", 1, _loads),
                 Item("its state equals one process's Adam after 3 steps on the whole batch (2 ranks)", 1,
                      _state_equal),
                 Item("loaded on every rank, 2 more steps give one process's Adam after 5 steps (2 ranks)", 1,
                      _resumed)), timeout_s=10),
        RunSpec(3, lambda n: _cases(n, [(34, 4, 2, 134, 2)]),
                (Item("its state equals one process's Adam after 2 steps on the whole batch (3 ranks)", 1,
                      _state_equal),
                 Item("loaded on every rank, 2 more steps give one process's Adam after 4 steps (3 ranks)", 1,
                      _resumed)), timeout_s=10),
    ),
    hints=(
        "Reread lesson 03, section 6 'ZeroRedundancyOptimizer: the optimizer's state, sharded' (what state_dict() "
        "needs first, on which ranks, and what the file holds).",
        "ZeroRedundancyOptimizer.consolidate_state_dict(to=...), .state_dict(), .load_state_dict(state_dict); "
        "torch.save, torch.load; dist.get_rank().",
        "Saving: gathering the shards is a collective, so every rank takes part; only the rank that received them "
        "writes the file. Loading: each rank's optimizer keeps the share it owns of whatever whole state it is "
        "given, so every rank reads the whole file.",
    ),
)
