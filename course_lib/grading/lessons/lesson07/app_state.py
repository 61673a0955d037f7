"""07.app_state: a `Stateful` for a run the lesson never saved (a torch.Generator per rank, an EMA of the model
kept on rank 0 only, as whole plain tensors, which a new launch does not have) whose save and resume in a new
run reproduce the uninterrupted run, bit for bit.

Judged: the resumed losses and rank 0's final EMA against the uninterrupted run's (exact), what the load
restored (step, each rank's own generator, parameters, Adam's state and lr, rank 0's EMA, no EMA on another
rank), and the uninterrupted run against one process replaying every rank's generator.
"""

from __future__ import annotations

import torch

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, DCP_PRELOAD, RTOL, where
from .drivers import one_process_app

__all__ = ["APP_STATE"]

APP_HINTS = (
    "Reread lesson 07, sections 1-3: what one run holds, which rank writes an entry that several ranks save "
    "under one name (section 2), state that differs per rank, resuming exactly in a new launch.",
    "torch.distributed.checkpoint.stateful.Stateful (state_dict, load_state_dict); get_state_dict and "
    "set_state_dict; torch.Generator.get_state / set_state; dist.get_rank(); dcp.load calls state_dict() "
    "first and fills the tensors it returned, in place: their shapes are the saved ones; a name that a rank's "
    "state dict lacks is simply not loaded there.",
    "state_dict() returns everything the next step depends on (model and optimizer, the step, this rank's "
    "generator state under a name of its own) and, on rank 0 alone, the EMA: the run's shadows, or, in a new "
    "launch that has none, empty tensors of the whole parameters' shapes for dcp.load to fill; "
    "load_state_dict() puts each back, the EMA into rank 0's run.ema.",
)

PART_WORDS = {"model": "the model's parameters", "optimizer": "Adam's state (moments and step counts)",
              "lr": "Adam's param_groups (its lr: the new run's Adam started at another; set_state_dict puts them back)",
              "step": "run.step", "ema": "rank 0's run.ema", "generator": "run.generator"}


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


def _ema_why(outcome: RunOutcome, case: int, rank: int) -> str:
    """Why run.ema did not come back: on another rank, that it holds one; on rank 0, what its shadows hold."""
    out = outcome.results[case][rank].output
    if rank != 0:
        return ("run.ema is no longer None after the load: only rank 0 keeps the EMA, and the other ranks must "
                "neither need it nor hold it")
    kinds = out["ema_kinds"]
    saved = out["ema_saved"]
    if out["ema_type"] == "none" and not saved["all"]:
        return ("run.ema is still None after the load, and the checkpoint holds no whole tensors of the "
                "parameters' shapes: rank 0's EMA was not saved")
    if out["ema_type"] == "none":
        return ("run.ema is still None after the load, although the checkpoint holds the shadows: the new launch "
                "starts without an EMA, so rank 0 handed dcp.load no tensors of the EMA's to fill, and none "
                "reached run.ema")
    if out["ema_type"] == "dtensor":
        return "run.ema holds DTensors after the load: rank 0's EMA is whole plain tensors, as saved"
    if out["ema_type"] == "not a dict":
        return "run.ema is not a dict {parameter name: tensor} after the load"
    other = sorted(name for name, kind in kinds.items() if kind == "other")
    if other and saved["by_others"]:
        return (f"run.ema[{other[0]!r}] holds values rank 0 never saved: rank {saved['by_others'][0]} wrote whole "
                "tensors of the shadows' shapes into the checkpoint; another rank saved a tensor under the same "
                "name, and DCP takes a plain tensor that several ranks save under one name for one replicated "
                "value, of which one rank writes its copy; the EMA must be saved under names no other rank saves")
    if all(kind == "fresh" for kind in kinds.values()):
        return ("run.ema equals the loaded weights: an EMA rebuilt from the weights forgets the average of the "
                "steps before; the saved shadows must come back")
    return ("run.ema is not the saved one: the shadows were left out of state_dict(), or the tensors DCP filled "
            "never reached run.ema")


def _resumed_exactly(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        stop_at, total, _ = outcome.inputs[case][0]
        out = result.output
        place = where(outcome, case, rank)
        failed = [(r, res.output["load_error"]) for r, res in sorted(outcome.results[case].items())
                  if res.output["load_error"]]
        if failed:
            bad, error = failed[0]
            why = ""
            if "Missing key in checkpoint" in error:
                why = (": the new launch's state_dict() holds an entry the saved run's did not (a None where the "
                       "saved run had a dict of tensors, as rank 0's run.ema in a new launch, is an entry of its "
                       "own); dcp.load fills only what was saved, into tensors of the saved shapes")
            return [f"{where(outcome, case, bad)}: dcp.load raised {error}{why}"]
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
            bad = next(r for r, res in sorted(ranks.items()) if not res.output["restored"]["ema"])
            return [f"{where(outcome, case, bad)}: {_ema_why(outcome, case, bad)}"]
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
        for name, want in (ema.items() if rank == 0 else ()):  # rank 0 alone keeps the EMA
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
                (Item("a new run loaded from the checkpoint reproduces the uninterrupted losses and rank 0's EMA, "
                      "bit for bit (2 ranks)", 2, _resumed_exactly),
                 Item("saving leaves the run unchanged: its losses and EMA equal one process (2 ranks)", 1,
                      _uninterrupted_is_one_process)),
                timeout_s=30),
    ),
)
