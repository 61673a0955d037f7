"""08.one_f_one_b: the 1F1B order of any (rank, stages, microbatches), as a list of actions.

The learner's function is pure; the driver calls it for every rank, refuses an order that cannot run (an
action missing or twice, a backward before its forward, a deadlock: each named with its rank, at once, with no
wait for a deadline), then runs each rank's order for real on gloo (activations forward, gradients back, as the
lesson's section 4 does). Judged: equal to one process; at most `stages - rank` microbatches alive on each rank;
the same order as torch's `Schedule1F1B` runs on the same ranks (recorded with hooks on the stage's module).
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import grad_wrong, one_process, where

__all__ = ["ONE_F_ONE_B"]

SEED = 18
ROWS_PER = 2  # rows per microbatch

HINTS = (
    "Reread lesson 08, section 4 (1F1B: warm-up, steady state, drain) and the orders section 5's 4-rank launch "
    "writes out for p = 4, m = 8.",
    "Plain Python: a list of (\"F\", i) and (\"B\", i) tuples; range; min. No torch.distributed call is needed.",
    "Rank r first runs as many forwards as it can before the gradient of microbatch 0 can come back: the stages "
    "after it each need one slot (never more than m in all). Then, while forwards remain, one forward and one "
    "backward in turn (the oldest microbatch's backward); then the backwards left, oldest first.",
)


def _m(outcome: RunOutcome, case: int) -> int:
    return outcome.inputs[case][0][2]


def _refused(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        if result.output["problem"]:
            # The problem names the rank whose order it is: every rank calls the function for every rank.
            return [f"case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks, {_m(outcome, case)} "
                    f"microbatches): {result.output['problem']}"]
    return []


def _equal(outcome: RunOutcome) -> list[str]:
    problems = _refused(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        _, stages, m, rows = outcome.inputs[case][rank]
        loss, want = one_process(stages, rows, SEED)
        out = result.output
        for name, value in want[rank].items():
            wrong = grad_wrong(out["grads"].get(name), value)
            if wrong:
                return [f"{where(outcome, case, rank, m)}: after your order ran, the gradient of the stage's "
                        f"{name} {wrong}"]
        if rank == stages - 1 and abs(out["loss"] - loss) > 1e-5 * abs(loss) + 1e-7:
            return [f"{where(outcome, case, rank, m)}: the loss is {out['loss']:g}, one process's {loss:g}"]
    return []


def _alive(outcome: RunOutcome) -> list[str]:
    problems = _refused(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        _, stages, m, _ = outcome.inputs[case][rank]
        out = result.output
        bound = min(stages - rank, m)
        if out["peak"] > bound:
            warm_up = min(stages - 1 - rank, m)
            forwards = sum(action[0] == "F" for action in out["order"][: out["order"].index("B0")])  # "F3", "B1"
            said = (f"{where(outcome, case, rank, m)}: {out['peak']} microbatches were alive at once (forward run, "
                    f"backward not yet), 1F1B holds at most stages - rank = {bound}: your order runs "
                    f"{forwards} forwards before B0; 1F1B runs {bound} (a warm-up of stages - 1 - rank = {warm_up} "
                    "on this rank, then the forward that goes with B0), then one forward, one backward, in turn")
            return [said]
    return []


def _as_torch(outcome: RunOutcome) -> list[str]:
    problems = _refused(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        out = result.output
        if out["order"] != out["torch"]:
            return [f"{where(outcome, case, rank, _m(outcome, case))}: your order {' '.join(out['order'])}; "
                    f"torch's Schedule1F1B ran {' '.join(out['torch'])} (recorded with hooks on its stage)"]
    return []


def _cases(nproc: int, ms: tuple[int, ...]) -> list[dict[int, tuple]]:
    return [{r: (SEED, nproc, m, ROWS_PER * m) for r in range(nproc)} for m in ms]


def _items(nproc: int) -> tuple[Item, ...]:
    return (
        Item(f"the orders run to the end on real ranks, equal to one process ({nproc} ranks)", 1, _equal),
        Item(f"at most stages - rank microbatches alive on each rank ({nproc} ranks)", 1, _alive),
        Item(f"the order torch's Schedule1F1B runs, on every rank ({nproc} ranks)", 1, _as_torch),
    )


ONE_F_ONE_B = Exercise(
    id="08.one_f_one_b",
    function="one_f_one_b_order",
    signature="one_f_one_b_order(rank: int, stages: int, microbatches: int) -> list[tuple[str, int]]",
    driver="one_f_one_b",
    hints=HINTS,
    preload=("torch.distributed.pipelining",),
    runs=(
        RunSpec(2, lambda n: _cases(n, (2, 5)), _items(2), timeout_s=25),
        RunSpec(4, lambda n: _cases(n, (4, 7)), _items(4), timeout_s=40),
    ),
)
