"""07.app_state: a `Stateful` for a run the lesson never saved (a torch.Generator per rank, an EMA shadow of the
model) whose save and resume in a new run reproduce the uninterrupted run, bit for bit.

Judged: the resumed losses and final EMA against the uninterrupted run's (exact), what the load restored
(step, each rank's own generator, parameters, Adam's state and lr, the EMA), and the uninterrupted run against
one process replaying every rank's generator.
"""

from __future__ import annotations

import torch

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, DCP_PRELOAD, RTOL, where
from .drivers import one_process_app

__all__ = ["APP_STATE"]

APP_HINTS = (
    "Reread lesson 07, sections 1-3: what one run holds, state that differs per rank, resuming exactly.",
    "torch.distributed.checkpoint.stateful.Stateful (state_dict, load_state_dict); get_state_dict and "
    "set_state_dict; torch.Generator.get_state / set_state; dist.get_rank(); what dcp.load does with the "
    "tensors state_dict() returned (it fills them in place).",
    "Return an object whose state_dict() gathers everything the next step depends on (model and optimizer, "
    "the step, the EMA shadows, and this rank's generator state under a name of its own) and whose "
    "load_state_dict() puts each of them back into the run it was made for; DCP calls both for you.",
)

PART_WORDS = {"model": "the model's parameters", "optimizer": "Adam's state (moments and step counts)",
              "lr": "Adam's param_groups (its lr: the new run's Adam started at another; set_state_dict puts them back)",
              "step": "run.step", "ema": "run.ema", "generator": "run.generator"}


def _app_cases(n: int) -> list[dict[int, tuple]]:
    return [{r: (3, 6, "app_state_3") for r in range(n)}, {r: (2, 5, "app_state_2") for r in range(n)}]


def _generator_why(outcome: RunOutcome, case: int, rank: int) -> str:
    """Why this rank's generator did not come back, from the fingerprints: another rank's, the new run's own."""
    by_rank = outcome.results[case]
    mine = by_rank[rank].output
    owners = [r for r, result in sorted(by_rank.items()) if result.output["generators"]["saved"] ==
              mine["generators"]["loaded"]]
    if owners:
        return (f"run.generator holds rank {owners[0]}'s saved state: saved under one name shared by the ranks, "
                "one rank's copy went to every rank; save it under a name per rank")
    if mine["generators"]["loaded"] == mine["generators"]["fresh"] and mine["global_rng_loaded"]:
        return ("run.generator is the new run's own while the global RNG was restored: the rows and dropout come "
                "from run.generator, whose state torch.get_rng_state() does not hold; save "
                "run.generator.get_state() and set_state it back")
    if mine["generators"]["loaded"] == mine["generators"]["fresh"]:
        return "run.generator is the new run's own: its state was not saved, or not set back with set_state"
    return "run.generator holds a state that no rank saved"


def _ema_why(out: dict) -> str:
    if out["ema_is_weights"]:
        return ("run.ema equals the loaded parameters: an EMA rebuilt from the weights forgets the average of the "
                "steps before; save the shadows themselves")
    return ("run.ema is not the saved one: leave the shadows out of state_dict(), or hand DCP copies that "
            "load_state_dict() never copies back, and the new run keeps its own")


def _resumed_exactly(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        stop_at, total, _ = outcome.inputs[case][0]
        out = result.output
        place = where(outcome, case, rank)
        if out["resumed_at"] != stop_at:
            return [f"{place}: the resumed run starts at step {out['resumed_at']}, expected {stop_at}: "
                    "run.step was not restored"]
        # A part any rank lost (the ranks share one loss: one rank's generator may come back right, the other's not).
        ranks = outcome.results[case]
        lost = [p for p in PART_WORDS if not all(r.output["restored"][p] for r in ranks.values())]
        if "generator" in lost:
            bad = next(r for r, res in sorted(ranks.items()) if not res.output["restored"]["generator"])
            return [f"{where(outcome, case, bad)}: {_generator_why(outcome, case, bad)}"]
        if "ema" in lost:
            return [f"{place}: {_ema_why(out)}"]
        for index, (got, want) in enumerate(zip(out["resumed"], out["uninterrupted"])):
            if got != want:
                why = f": not restored by the load: {', '.join(PART_WORDS[p] for p in lost)}" if lost else ""
                return [f"{place}: resumed at step {stop_at}, the loss of step {stop_at + index + 1} is "
                        f"{got:.6f}, the uninterrupted run's {want:.6f}{why}"]
        for name, want in out["uninterrupted_ema"].items():
            wrong = first_difference(out["resumed_ema"].get(name), want, what=f"run.ema[{name!r}]")
            if wrong:
                return [f"{place}: after step {total}, run.ema[{name!r}] {wrong} (the uninterrupted run's, exact)"]
        if lost:
            return [f"{place}: the losses match, but the load did not restore "
                    f"{', '.join(PART_WORDS[p] for p in lost)}"]
    return []


def _uninterrupted_is_one_process(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        stop_at, total, _ = outcome.inputs[case][0]
        losses, ema = one_process_app(outcome.nproc, total)
        out = result.output
        if out["save_changed_generator"]:
            return [f"{where(outcome, case, rank)}: saving changed run.generator: state_dict() must read its "
                    "state (get_state()), not draw from it"]
        wrong = first_difference(torch.tensor(out["uninterrupted"]), torch.tensor(losses[stop_at:]),
                                 rtol=RTOL, atol=ATOL)
        if wrong:
            return [f"{where(outcome, case, rank)}: the run that saved at step {stop_at} and went on: its losses "
                    f"of steps {stop_at + 1}-{total} {wrong} (one process replaying each rank's generator)"]
        for name, want in ema.items():
            wrong = first_difference(out["uninterrupted_ema"][name], want, rtol=RTOL, atol=ATOL)
            if wrong:
                return [f"{where(outcome, case, rank)}: the run that saved at step {stop_at} and went on: "
                        f"run.ema[{name!r}] after step {total} {wrong} (one process)"]
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
                (Item("a new run loaded from the checkpoint reproduces the uninterrupted losses and EMA, bit for "
                      "bit (2 ranks)", 2, _resumed_exactly),
                 Item("saving leaves the run unchanged: its losses and EMA equal one process (2 ranks)", 1,
                      _uninterrupted_is_one_process)),
                timeout_s=30),
    ),
)
