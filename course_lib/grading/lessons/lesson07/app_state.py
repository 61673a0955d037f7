"""07.app_state: a `Stateful` whose save and resume in a new run reproduce the uninterrupted run, bit for bit.

Judged: the resumed losses against the uninterrupted run's (exact), what the load restored (step, epoch, each
rank's own random state, parameters, Adam's state and lr, the scheduler), and the uninterrupted run against one
process replaying every rank's noise.
"""

from __future__ import annotations

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, DCP_PRELOAD, RTOL, where
from .drivers import one_process_ranks

__all__ = ["APP_STATE"]

APP_HINTS = (
    "Reread lesson 07, sections 1-3: what one run holds, state that differs per rank, resuming exactly.",
    "torch.distributed.checkpoint.stateful.Stateful (state_dict, load_state_dict); get_state_dict and "
    "set_state_dict; the scheduler's own state_dict / load_state_dict; torch.get_rng_state / set_rng_state; "
    "the sampler's epoch and set_epoch; dist.get_rank().",
    "Return an object whose state_dict() gathers everything the next step depends on (model and optimizer, "
    "the scheduler, the step, the sampler's epoch, and this rank's random state under a name of its own) and "
    "whose load_state_dict() puts each of them back into the run it was made for; DCP calls both for you.",
)

PART_WORDS = {"model": "the model's parameters", "optimizer": "Adam's state (moments and step counts)",
              "lr": "Adam's param_groups (its lr: the new run's Adam started at another; set_state_dict puts them back)",
              "scheduler": "the scheduler's state", "step": "run.step", "epoch": "the sampler's epoch",
              "rng": "this rank's own random state (ranks are seeded apart: under one name every rank gets one "
                     "rank's copy; save it under a name per rank)"}


def _app_cases(n: int) -> list[dict[int, tuple]]:
    return [{r: (3, 6, "app_state_3") for r in range(n)}, {r: (2, 5, "app_state_2") for r in range(n)}]


def _resumed_exactly(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        stop_at, total, _ = outcome.inputs[case][0]
        out = result.output
        place = where(outcome, case, rank)
        # A part any rank lost (one rank's RNG may come back right, the other's not: they share one loss).
        ranks = outcome.results[case].values()
        missing = [PART_WORDS[p] for p in out["restored"] if not all(r.output["restored"][p] for r in ranks)]
        if out["resumed_at"] != stop_at:
            return [f"{place}: the resumed run starts at step {out['resumed_at']}, expected {stop_at}: "
                    f"run.step was not restored" + (f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else "")]
        expected = out["uninterrupted"]
        for index, (got, want) in enumerate(zip(out["resumed"], expected)):
            if got != want:
                why = f": not restored by the load: {', '.join(missing)}" if missing else ""
                return [f"{place}: resumed at step {stop_at}, the loss of step {stop_at + index + 1} is "
                        f"{got:.6f}, the uninterrupted run's {want:.6f}{why}"]
        if missing:
            return [f"{place}: the losses match, but the load did not restore {', '.join(missing)}"]
    return []


def _uninterrupted_is_one_process(outcome: RunOutcome) -> list[str]:
    import torch

    for case, rank, result in each_result(outcome):
        stop_at, total, _ = outcome.inputs[case][0]
        losses = one_process_ranks(outcome.nproc, total)
        out = result.output
        if out["save_changed_rng"]:
            return [f"{where(outcome, case, rank)}: saving changed the global random state: state_dict() must "
                    "read the state (torch.get_rng_state()), not draw from it"]
        wrong = first_difference(torch.tensor(out["uninterrupted"]), torch.tensor(losses[stop_at:]),
                                 rtol=RTOL, atol=ATOL)
        if wrong:
            return [f"{where(outcome, case, rank)}: the run that saved at step {stop_at} and went on: its losses "
                    f"of steps {stop_at + 1}-{total} {wrong} (one process replaying each rank's noise)"]
    return []


APP_STATE = Exercise(
    id="07.app_state",
    hints=APP_HINTS,
    function="app_state",
    signature="app_state(run) -> Stateful",
    driver="dcp_app_state",
    preload=DCP_PRELOAD,
    runs=(
        RunSpec(2, _app_cases,
                (Item("a new run loaded from the checkpoint reproduces the uninterrupted losses, bit for bit "
                      "(2 ranks)", 2, _resumed_exactly),
                 Item("saving leaves the run unchanged: its losses equal one process (2 ranks)", 1,
                      _uninterrupted_is_one_process)),
                timeout_s=30),
    ),
)
