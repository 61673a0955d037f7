"""Lesson 03's exercises: uneven inputs under the Join context manager, a Joinable of one's own, ZeRO's state saved.

The model is lesson 02's Linear-ReLU-Linear (weights drawn here, in the
checker's process, from a fixed seed) with `F.mse_loss`. Ranks get different
numbers of batches. The references are one process, computed here without
torch.distributed: for DDP under Join, step k sums the gradients of the ranks
that still have a batch k and divides by the initial world size (DDP's
default, `divide_by_initial_world_size=True`: a joined rank contributes
zeros); for the counter, the number of calls over all ranks; for ZeRO, Adam
on the whole batch. Judges name the rank, the case and the first wrong value,
and recognise the usual mistakes (dividing by the ranks still training, a
join hook that counts a joined rank as taking part or that adds nothing, the
state of rank 0's shard only).
"""

from __future__ import annotations

import io

from ...compare import first_difference
from ..lesson02.exercises import ATOL, DDP_PRELOAD, NAMES, RTOL, _batch, _grads, _model, _weights
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["ADAM_LR", "ATOL", "EXERCISES", "LR", "RTOL", "STATE_ATOL", "STATE_RTOL", "adam_reference",
           "join_reference"]

LR = 0.1  # SGD's learning rate in 03.join_uneven_training
ADAM_LR = 0.01  # Adam's in 03.zero_consolidate_save
# Adam's moments are small here (down to 1.3e-7): lesson 02's atol of 1e-6 would pass any of them, so
# the state is compared within rtol 1e-4 and atol 1e-9. The solution is off by up to 3.1e-6 of a value
# (an exp_avg_sq, the square of a gradient summed in another order), so rtol 1e-5 would leave little room.
STATE_RTOL, STATE_ATOL = 1e-4, 1e-9
ALL_REDUCE = frozenset({"all_reduce"})
ZERO_PRELOAD = DDP_PRELOAD + ("torch.distributed.optim.zero_redundancy_optimizer",)


def _counts_label(counts: list[int]) -> str:
    return ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))


# ---------------------------------------------------------------- 03.join_uneven_training


def _uneven_cases(n: int, specs: list[tuple[int, tuple[int, ...], int, int]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, batches per rank, rows per batch, batch seed): rank r gets counts[r] batches."""
    cases = []
    for weights_seed, counts, rows, batch_seed in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(sum(counts[:n]) * rows, batch_seed)
        case, start = {}, 0
        for r in range(n):
            case[r] = (weights, [(inputs[s:s + rows], targets[s:s + rows])
                                 for s in range(start, start + counts[r] * rows, rows)], LR)
            start += counts[r] * rows
        cases.append(case)
    return cases


def join_reference(weights: list, batches_per_rank: list[list], lr: float, divide_by_initial: bool = True) -> dict:
    """{name: parameter} after SGD under DDP and Join, in one process.

    Step k: the gradients of the ranks that still have a batch k, summed, divided by the initial world
    size (or, with `divide_by_initial=False`, by the number of those ranks); then an SGD step. A rank
    that has joined contributes zeros. Every rank ends with these parameters: Join's post-hook
    broadcasts the last joiner's model.
    """
    import torch

    n = len(batches_per_rank)
    params = [w.clone() for w in weights]
    for k in range(max(len(b) for b in batches_per_rank)):
        active = [b[k] for b in batches_per_rank if k < len(b)]
        total = None
        for inputs, targets in active:
            grads = _grads(params, inputs, targets)
            total = [grads[name] for name in NAMES] if total is None else \
                [t + grads[name] for t, name in zip(total, NAMES)]
        divisor = n if divide_by_initial else len(active)
        model = _model(params)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        for parameter, grad in zip(model.parameters(), total):
            parameter.grad = grad / divisor
        optimizer.step()
        params = [p.detach().clone() for p in model.parameters()]
    return dict(zip(NAMES, params))


def _counts(outcome: RunOutcome, case: int) -> list[int]:
    return [len(outcome.inputs[case][r][1]) for r in range(outcome.nproc)]


def _uneven_label(outcome: RunOutcome, case: int) -> str:
    rows = outcome.inputs[case][0][1][0][0].shape[0]
    return (f"case {case + 1} of {len(outcome.inputs)} (batches of {rows} rows per rank: "
            f"{_counts_label(_counts(outcome, case))})")


def _trained(outcome: RunOutcome) -> list[str]:
    """Every rank's parameters equal one process's SGD under Join's rule (divided by the initial world size)."""
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights, _, lr = outcome.inputs[case][0]
        batches = [outcome.inputs[case][r][1] for r in range(n)]
        expected = join_reference(weights, batches, lr)
        last = max(range(n), key=lambda r: (len(batches[r]), r))  # a rank with the most batches
        for rank in range(n):
            got = by_rank[rank].output["params"]
            where = f"rank {rank}, {_uneven_label(outcome, case)}"
            for name in NAMES:
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = ""
                by_active = join_reference(weights, batches, lr, divide_by_initial=False)
                if not first_difference(got[name], by_active[name], rtol=RTOL, atol=ATOL):
                    hint = (": that is the training with divide_by_initial_world_size=False (each step divided "
                            "by the ranks still training); keep the default, True: a joined rank contributes "
                            f"zeros and the sum is divided by the initial world size, {n}")
                elif first_difference(got[name], by_rank[last].output["params"][name], rtol=RTOL, atol=ATOL):
                    hint = (f": rank {rank} ends with other parameters than rank {last}, which had the most "
                            "batches; under Join its post-hook broadcasts the last joiner's model to every rank")
                return [f"{where}: {name} {wrong}{hint}"]
    return []


JOIN_TRAINING = Exercise(
    id="03.join_uneven_training",
    function="train",
    signature=("train(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, "
               "batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None"),
    driver="ddp_join_training",
    allowed_ops=ALL_REDUCE,
    preload=DDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _uneven_cases(n, [(31, (2, 3), 3, 131)]),
                (Item("finishes, and every rank ends with one process's parameters (2 ranks: 2 and 3 batches)",
                      1, _trained),), timeout_s=10),
        RunSpec(3, lambda n: _uneven_cases(n, [(32, (2, 4, 3), 3, 132)]),
                (Item("finishes, and every rank ends with one process's parameters (3 ranks: 2, 4 and 3 "
                      "batches)", 1, _trained),), timeout_s=10),
    ),
)


# ---------------------------------------------------------------- 03.counting_joinable


def _iteration_cases(n: int, specs: list[tuple[int, ...]]) -> list[dict[int, tuple]]:
    """One case per tuple of iterations, rank r calling the counter counts[r] times."""
    return [{r: (counts[r],) for r in range(n)} for counts in specs]


def _iterations(outcome: RunOutcome, case: int) -> list[int]:
    return [outcome.inputs[case][r][0] for r in range(outcome.nproc)]


def _iterations_label(outcome: RunOutcome, case: int) -> str:
    return f"case {case + 1} of {len(outcome.inputs)} (calls per rank: {_counts_label(_iterations(outcome, case))})"


def _not_joinable(outcome: RunOutcome) -> str:
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            if "not_joinable" in result.output:
                return (f"rank {rank}, {_iterations_label(outcome, case)}: Counter() made a "
                        f"{result.output['not_joinable']}, not a Joinable; subclass "
                        "torch.distributed.algorithms.join.Joinable")
    return ""


def _counted(outcome: RunOutcome) -> list[str]:
    """Every rank's count equals the number of calls over all ranks (the ranks taking part, summed over iterations)."""
    n = outcome.nproc
    if (problem := _not_joinable(outcome)):
        return [problem]
    for case, by_rank in enumerate(outcome.results):
        counts = _iterations(outcome, case)
        expected = float(sum(counts))
        for rank in range(n):
            got = by_rank[rank].output["count"]
            where = f"rank {rank}, {_iterations_label(outcome, case)}"
            if not isinstance(got, float):
                return [f"{where}: counter.count is a {got}, expected a number or a one-element tensor"]
            if got == expected:
                continue
            own = float(sum(sum(1 for c in counts if c > k) for k in range(counts[rank])))
            hint = ""
            if got == float(n * max(counts)):
                hint = (f": that is {n} ranks times {max(counts)} iterations, every rank counted in every "
                        "iteration; a joined rank takes no part: its main_hook all-reduces zeros, not ones")
            elif got == own:
                hint = (f": that counts only the {counts[rank]} iteration{'s' if counts[rank] != 1 else ''} this "
                        "rank took part in; a joined rank's main_hook must all-reduce zeros (matching the others' "
                        "all-reduce of ones) and add the result to count, so that it counts their iterations too")
            return [f"{where}: count is {got:g}, expected {expected:g} (the ranks taking part in each "
                    f"iteration, summed){hint}"]
    return []


def _last_joiner(outcome: RunOutcome) -> list[str]:
    """post_hook recorded is_last_joiner: True exactly on the ranks with the most calls."""
    if (problem := _not_joinable(outcome)):
        return [problem]
    for case, by_rank in enumerate(outcome.results):
        counts = _iterations(outcome, case)
        for rank, result in sorted(by_rank.items()):
            got, expected = result.output["is_last_joiner"], counts[rank] == max(counts)
            if got == expected and isinstance(got, bool):
                continue
            where = f"rank {rank}, {_iterations_label(outcome, case)}"
            if got is None:
                return [f"{where}: counter.is_last_joiner is None afterwards; post_hook(is_last_joiner) must "
                        "store it on the counter"]
            if not isinstance(got, bool):
                return [f"{where}: counter.is_last_joiner is a {got}, expected a bool"]
            why = "the most calls" if expected else f"fewer calls than {max(counts)}"
            return [f"{where}: is_last_joiner is {got}, expected {expected} (this rank made {why})"]
    return []


COUNTING = Exercise(
    id="03.counting_joinable",
    function="Counter",
    signature="class Counter(Joinable): __call__() -> None, join_hook(**kwargs) -> JoinHook",
    driver="counting_joinable",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _iteration_cases(n, [(2, 3)]),
                (Item("every rank counts 5 calls (2 ranks: 2 and 3 calls)", 1, _counted),
                 Item("post_hook: is_last_joiner True on the rank with the most calls only (2 ranks)", 1,
                      _last_joiner)), timeout_s=10),
        RunSpec(3, lambda n: _iteration_cases(n, [(1, 3, 2), (3, 1, 3)]),
                (Item("every rank counts all calls (3 ranks: 1, 3, 2 and 3, 1, 3 calls)", 1, _counted),
                 Item("post_hook: is_last_joiner True on the ranks with the most calls, a tie included (3 ranks)",
                      1, _last_joiner)), timeout_s=10),
    ),
)


# ---------------------------------------------------------------- 03.zero_consolidate_save


def _zero_cases(n: int, specs: list[tuple[int, int, int, int]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, steps, rows per rank, batch seed): rank r's shard of each step's batch."""
    cases = []
    for index, (weights_seed, steps, rows, batch_seed) in enumerate(specs):
        weights, (inputs, targets) = _weights(weights_seed), _batch(steps * n * rows, batch_seed)
        case = {}
        for r in range(n):
            starts = [(k * n + r) * rows for k in range(steps)]
            case[r] = (weights, [(inputs[s:s + rows], targets[s:s + rows]) for s in starts], ADAM_LR,
                       f"optimizer_case{index + 1}.pt")
        cases.append(case)
    return cases


def adam_reference(weights: list, batches: list, lr: float):
    """A plain torch.optim.Adam(lr) after one step per (inputs, targets) of `batches` (whole batches), one process."""
    import torch

    model = _model(weights)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for inputs, targets in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return optimizer


def _whole_batches(outcome: RunOutcome, case: int) -> list[tuple]:
    import torch

    steps = len(outcome.inputs[case][0][1])
    shards = [outcome.inputs[case][r][1] for r in range(outcome.nproc)]
    return [(torch.cat([s[k][0] for s in shards]), torch.cat([s[k][1] for s in shards])) for k in range(steps)]


def _zero_label(outcome: RunOutcome, case: int) -> str:
    steps = outcome.inputs[case][0][1]
    return (f"case {case + 1} of {len(outcome.inputs)} ({len(steps)} Adam steps, {steps[0][0].shape[0]} rows "
            f"per rank per step)")


def _loaded(outcome: RunOutcome, case: int):
    """(a plain Adam over the model that loaded rank 0's file, "") or (None, what went wrong)."""
    import torch

    weights, _, lr, name = outcome.inputs[case][0]
    where = f"rank 0, {_zero_label(outcome, case)}"
    saved = outcome.results[case][0].output["saved"]
    if saved is None:
        return None, (f"{where}: no file at the path given after save_optimizer returned; rank 0 must "
                      "torch.save(optimizer.state_dict(), path)")
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
                      "rank's shard (optimizer.optim.state_dict()?); call optimizer.consolidate_state_dict(to=0) "
                      "on every rank, then save optimizer.state_dict() on rank 0")
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
        weights, _, lr, _ = outcome.inputs[case][0]
        reference = adam_reference(weights, _whole_batches(outcome, case), lr)
        got_params = [p for group in optimizer.param_groups for p in group["params"]]
        want_params = [p for group in reference.param_groups for p in group["params"]]
        for name, got_p, want_p in zip(NAMES, got_params, want_params):
            got, want = optimizer.state.get(got_p, {}), reference.state[want_p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in got:
                    return [f"rank 0, {_zero_label(outcome, case)}: no {key} for {name} in the saved state"]
                wrong = first_difference(got[key].float(), want[key].float(), rtol=STATE_RTOL, atol=STATE_ATOL)
                if wrong:
                    return [f"rank 0, {_zero_label(outcome, case)}: {name}'s {key} {wrong}"]
    return []


ZERO_SAVE = Exercise(
    id="03.zero_consolidate_save",
    function="save_optimizer",
    signature="save_optimizer(optimizer: ZeroRedundancyOptimizer, path: str) -> None",
    driver="zero_save",
    allowed_ops=frozenset({"all_reduce", "broadcast"}),
    preload=ZERO_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _zero_cases(n, [(33, 3, 4, 133)]),
                (Item("rank 0's file loads into a plain torch.optim.Adam (2 ranks)", 1, _loads),
                 Item("its state equals one process's Adam after 3 steps on the whole batch (2 ranks)", 1,
                      _state_equal)), timeout_s=10),
        RunSpec(3, lambda n: _zero_cases(n, [(34, 2, 2, 134)]),
                (Item("its state equals one process's Adam after 2 steps on the whole batch (3 ranks)", 1,
                      _state_equal),), timeout_s=10),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (JOIN_TRAINING, COUNTING, ZERO_SAVE)}
