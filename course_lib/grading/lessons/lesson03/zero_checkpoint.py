"""03.zero_sharded_checkpoint: ZeroRedundancyOptimizer's Adam state saved by each rank, with no collective,
then resumed on the same number of ranks or on another.

The checker trains DDP + ZeroRedundancyOptimizer(Adam) on `world_save` ranks (a group of ranks 0..world_save-1,
each its rows of each step's batch), calls the learner's `save_shards(optimizer, folder)` on each of them,
waits for every rank, builds a new DDP and ZeroRedundancyOptimizer over the same (trained) parameters on
`world_load` ranks, calls `load_shards(new, folder)` on each of those and trains the remaining steps.

References, in this process: the parameters after resuming equal one process's Adam over every step's whole
batch; `save_shards` makes no collective (read from the ledger between its start and its return). Judges
recognise: the state keyed by the inner optimizer's own index (shapes that do not fit), each rank reading
only the file it wrote (the parameters whose owner changed resume from zero moments), rank 0's share alone
saved, nothing restored, and a gather while saving (lesson 03's consolidate_state_dict).
"""

from __future__ import annotations

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ADAM_LR, ATOL, NAMES, RTOL, ZERO_PRELOAD, _batch, _weights, greedy_owners, optimizer_reference

__all__ = ["ZERO_SHARDED"]

WHOLE_ROWS = 12  # rows of each step's whole batch: 6 per rank on 2 ranks, 4 on 3


def _cases(n: int, specs: list[tuple[int, int, int, int, int, int]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, batch seed, steps before the save, steps after, ranks saving, ranks
    resuming): rank r gets (weights, its rows of each step before, its rows of each step after, ranks
    saving, ranks resuming, lr, folder name); no rows for a phase it sits out."""
    cases = []
    for i, (weights_seed, batch_seed, before, after, world_save, world_load) in enumerate(specs):
        weights, (inputs, targets) = _weights(weights_seed), _batch((before + after) * WHOLE_ROWS, batch_seed)
        steps = [(inputs[k * WHOLE_ROWS:(k + 1) * WHOLE_ROWS], targets[k * WHOLE_ROWS:(k + 1) * WHOLE_ROWS])
                 for k in range(before + after)]

        def rows(pairs, world, r):
            share = WHOLE_ROWS // world
            return [(x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]) for x, y in pairs] if r < world else []

        cases.append({r: (weights, rows(steps[:before], world_save, r), rows(steps[before:], world_load, r),
                          world_save, world_load, ADAM_LR, f"checkpoint_case{i + 1}") for r in range(n)})
    return cases


def _phases(outcome: RunOutcome, case: int) -> tuple[int, int, int, int]:
    """(steps before the save, steps after, ranks saving, ranks resuming) of a case."""
    _, before, after, world_save, world_load, _, _ = outcome.inputs[case][0]
    return len(before), len(after), world_save, world_load


def _label(outcome: RunOutcome, case: int) -> str:
    before, after, world_save, world_load = _phases(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} ({before} Adam steps on {world_save} ranks, saved, "
            f"{after} more after loading on {world_load})")


def _whole_batches(outcome: RunOutcome, case: int) -> list[tuple]:
    """Each step's whole batch: the rows of the ranks that took it, in rank order."""
    import torch

    before, after, world_save, world_load = _phases(outcome, case)
    inputs = outcome.inputs[case]
    whole = []
    for k in range(before + after):
        world, index, slot = (world_save, k, 1) if k < before else (world_load, k - before, 2)
        pairs = [inputs[r][slot][index] for r in range(world)]
        whole.append((torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])))
    return whole


def _resumed_reference(outcome: RunOutcome, case: int, fresh: set[int]) -> dict:
    """Parameters after every step, one process; the Adam state of the parameters (by index) in `fresh`
    dropped at the save: those resumed from zero moments and step 0."""
    weights, _, _, _, _, lr, _ = outcome.inputs[case][0]
    before = _phases(outcome, case)[0]
    batches = _whole_batches(outcome, case)
    model, optimizer = optimizer_reference(weights, batches[:before], "Adam", {"lr": lr})
    for index, p in enumerate(model.parameters()):
        if index in fresh:
            optimizer.state.pop(p, None)
    model, _ = optimizer_reference(weights, batches[before:], model=model, optimizer=optimizer)
    return {k: v.detach() for k, v in model.named_parameters()}


def _owners(outcome: RunOutcome, case: int, world: int) -> list[int]:
    return greedy_owners([w.numel() for w in outcome.inputs[case][0][0]], world)


def _no_collective_while_saving(outcome: RunOutcome) -> list[str]:
    """No rank calls a collective between entering save_shards and returning from it (the ledger)."""
    for case, rank, result in each_result(outcome):
        span = result.output.get("save_span")
        if span is None:
            continue
        calls = [e for e in result.ledger if span[0] <= e["start"] <= span[1]]
        if calls:
            named = ", ".join(f"{e['op']} #{e['seq']} ({e['bytes']} B)" for e in calls[:3])
            more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
            return [f"rank {rank}, {_label(outcome, case)}: save_shards called {named}{more}; each rank writes "
                    "the state it holds, without communicating: gathering every share on one rank (as "
                    "consolidate_state_dict does) needs that rank to hold the whole state at once"]
    return []


def _resumed(case_index: int) -> callable:
    """After load_shards on every resuming rank, the remaining steps give one process's Adam over all steps."""

    def judge(outcome: RunOutcome) -> list[str]:
        case, by_rank = case_index, outcome.results[case_index]
        _, _, world_save, world_load = _phases(outcome, case)
        where = _label(outcome, case)
        for rank in range(world_load):
            error = by_rank[rank].output.get("load_error")
            if error:
                hint = ""
                if error.startswith("FileNotFoundError") and world_load > world_save:
                    hint = (f": only ranks 0 to {world_save - 1} saved; on {world_load} ranks a rank may find no file "
                            "of its own, and the state it now owns is in the others' files")
                return [f"rank {rank}, {where}: load_shards raised {error}{hint}"]
            problem = by_rank[rank].output.get("shape_problem")
            if problem:
                return [f"rank {rank}, {where}: after load_shards, {problem}: that state belongs to another "
                        "parameter; the inner optimizer numbers its own parameters 0, 1, ... on every rank, while a "
                        "plain optimizer's state_dict numbers every parameter of the model, in the order of "
                        "optimizer.param_groups"]
        expected = _resumed_reference(outcome, case, set())
        old, new = _owners(outcome, case, world_save), _owners(outcome, case, world_load)
        named = [
            (set(range(len(NAMES))), "that is Adam resumed with no state at all (the moments and step count start "
                                     "again from zero); the new optimizer must continue from the files"),
            ({i for i, o in enumerate(old) if o != 0}, "that is the state of rank 0's share alone: the parameters "
                                                       "the other ranks owned resumed from zero moments; every rank "
                                                       "saves its own share"),
            ({i for i in range(len(NAMES)) if old[i] != new[i]},
             f"that is each rank reading only its own file: the owners change with the number of ranks (on "
             f"{world_save}, {_owned(old)}; on {world_load}, {_owned(new)}), so a rank needs the shares other ranks "
             "saved"),
        ]
        for rank in range(world_load):
            got = by_rank[rank].output["params"]
            for name in NAMES:
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                message = f"rank {rank}, {where}: after resuming, {name} {wrong}"
                for fresh, why in named:
                    if fresh and not first_difference(got[name], _resumed_reference(outcome, case, fresh)[name],
                                                      rtol=RTOL, atol=ATOL):
                        return [f"{message}: {why}"]
                return [message]
        return []

    judge.__doc__ = f"case {case_index + 1}: {_resumed.__doc__}"
    return judge


def _owned(owner: list[int]) -> str:
    """Owners in words: "rank 0: 0.weight; rank 1: 0.bias, 2.weight, 2.bias"."""
    ranks = sorted(set(owner))
    return "; ".join(f"rank {r}: " + ", ".join(n for n, o in zip(NAMES, owner) if o == r) for r in ranks)


ZERO_SHARDED = Exercise(
    id="03.zero_sharded_checkpoint",
    function="save_shards",
    signature=("save_shards(optimizer: ZeroRedundancyOptimizer, folder: str) -> None; "
               "load_shards(optimizer: ZeroRedundancyOptimizer, folder: str) -> None"),
    driver="zero_sharded_checkpoint",
    allowed_ops=frozenset({"all_reduce", "broadcast"}),
    preload=ZERO_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _cases(n, [(33, 133, 3, 2, 2, 2)]),
                (Item("save_shards makes no collective: each rank writes the state it holds (2 ranks)", 1,
                      _no_collective_while_saving),
                 Item("saved on 2 ranks, loaded on the same 2: 2 more steps give one process's Adam after 5 steps", 1,
                      _resumed(0))), timeout_s=15),
        RunSpec(3, lambda n: _cases(n, [(34, 134, 2, 2, 3, 2), (35, 135, 2, 2, 2, 3)]),
                (Item("save_shards makes no collective: each rank writes the state it holds (3 ranks)", 1,
                      _no_collective_while_saving),
                 Item("saved on 3 ranks, loaded on 2: 2 more steps give one process's Adam after 4 steps", 1,
                      _resumed(0)),
                 Item("saved on 2 ranks, loaded on 3: 2 more steps give one process's Adam after 4 steps", 1,
                      _resumed(1))), timeout_s=15),
    ),
    hints=(
        "Reread lesson 03, section 6 'ZeroRedundancyOptimizer: the optimizer's state, sharded': what the "
        "consolidated file holds, how load_state_dict on every rank keeps each rank's share of it, and why the "
        "owners depend on the number of ranks.",
        "ZeroRedundancyOptimizer.optim (the inner optimizer over this rank's parameters; its .state is keyed by "
        "parameter), .param_groups (every parameter of the model, in order), .load_state_dict(state_dict); "
        "torch.save, torch.load, os.listdir, os.path.join; dist.get_rank().",
        "Saving: key each parameter's state by its position among all the optimizer's parameters, not by its "
        "position in the inner optimizer (that one differs from rank to rank), and write one file per rank. "
        "Loading: read every file, whichever rank wrote it, merge them into one plain optimizer's state_dict "
        "(its state and its param_groups) and give that to load_state_dict, on every rank.",
    ),
)
