"""Lesson 07's exercises: a `Stateful` app state whose resume reproduces the uninterrupted run (app_state), a
checkpoint saved on N ranks loaded into another layout (reshard_load), a save that a rank lost in the middle
cannot turn into the checkpoint a restart loads (crash_safe_save).

Every run trains lesson 07's run (drivers.train: lessons 04-05's model, Adam, a shuffled sampler, noise from
the global RNG) with FSDP2 over a CPU mesh (gloo). References are one process, computed here with the same
`train` and no torch.distributed.
"""

from __future__ import annotations

import functools

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .drivers import full_state, new_run, train

__all__ = ["ATOL", "EXERCISES", "RTOL", "one_process"]

RTOL, ATOL = 1e-5, 1e-6
DCP_PRELOAD = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
               "torch.distributed.checkpoint.state_dict")


@functools.cache
def one_process(steps: int) -> tuple[list[float], dict]:
    """One process's losses of the first `steps` steps and its state afterwards (drivers.full_state)."""
    run = new_run(None)
    losses = train(run, steps)
    return losses, full_state(run.model, run.optimizer)


def _where(outcome: RunOutcome, case: int, rank: int) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks)"


def _state_wrong(got: dict, want: dict, parts=("model", "exp_avg", "exp_avg_sq")) -> str:
    """"" if `got`'s parameters and Adam moments equal `want`'s; else the first difference, in words."""
    for part in (p for p in parts if p != "steps"):
        for name, value in want[part].items():
            if name not in got[part]:
                what = "the parameter" if part == "model" else f"Adam's {part}"
                return f"{what} of {name} is missing (the optimizer holds no state for it)"
            wrong = first_difference(got[part][name], value, rtol=RTOL, atol=ATOL)
            if wrong:
                what = name if part == "model" else f"Adam's {part} of {name}"
                return f"{what} {wrong}"
    if "steps" in parts and got["steps"] != want["steps"]:
        return f"Adam's step counters are {sorted(set(got['steps'].values()))}, expected {sorted(set(want['steps'].values()))}"
    return ""


# ---------------------------------------------------------------------------------------------- 07.app_state

APP_HINTS = (
    "Reread lesson 07, section 1 'What one training run holds' and section 3 'Resume exactly, in a new launch'.",
    "torch.distributed.checkpoint.stateful.Stateful (state_dict, load_state_dict); get_state_dict and "
    "set_state_dict from torch.distributed.checkpoint.state_dict; torch.get_rng_state / torch.set_rng_state; "
    "the sampler's epoch and set_epoch.",
    "Return an object whose state_dict() gathers everything the next step depends on (the model's and the "
    "optimizer's state dicts, the step, the sampler's epoch, the random state) and whose load_state_dict() "
    "puts each of them back into the run it was made for; DCP calls both for you.",
)

PART_WORDS = {"model": "the model's parameters", "optimizer": "Adam's state (moments and step counts)",
              "step": "run.step", "epoch": "the sampler's epoch", "rng": "the global random state"}


def _app_cases(n: int) -> list[dict[int, tuple]]:
    return [{r: (3, 6, "app_state_3") for r in range(n)}, {r: (2, 5, "app_state_2") for r in range(n)}]


def _resumed_exactly(outcome: RunOutcome) -> list[str]:
    for case, by_rank in enumerate(outcome.results):
        stop_at, total, _ = outcome.inputs[case][0]
        for rank, result in sorted(by_rank.items()):
            out = result.output
            where = _where(outcome, case, rank)
            missing = [PART_WORDS[p] for p, ok in out["restored"].items() if not ok]
            if out["resumed_at"] != stop_at:
                return [f"{where}: the resumed run starts at step {out['resumed_at']}, expected {stop_at}: "
                        f"run.step was not restored" + (f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else "")]
            expected = out["uninterrupted"]
            for index, (got, want) in enumerate(zip(out["resumed"], expected)):
                if got != want:
                    why = f": not restored by the load: {', '.join(missing)}" if missing else ""
                    return [f"{where}: resumed at step {stop_at}, the loss of step {stop_at + index + 1} is "
                            f"{got:.6f}, the uninterrupted run's {want:.6f}{why}"]
            if missing:
                return [f"{where}: the losses match, but the load did not restore {', '.join(missing)}"]
    return []


def _uninterrupted_is_one_process(outcome: RunOutcome) -> list[str]:
    import torch

    for case, by_rank in enumerate(outcome.results):
        stop_at, total, _ = outcome.inputs[case][0]
        losses, _ = one_process(total)
        for rank, result in sorted(by_rank.items()):
            out = result.output
            if out["save_changed_rng"]:
                return [f"{_where(outcome, case, rank)}: saving changed the global random state: state_dict() must "
                        "read the state (torch.get_rng_state()), not draw from it"]
            wrong = first_difference(torch.tensor(out["uninterrupted"]), torch.tensor(losses[stop_at:]),
                                     rtol=RTOL, atol=ATOL)
            if wrong:
                return [f"{_where(outcome, case, rank)}: the run that saved at step {stop_at} and went on: its losses "
                        f"of steps {stop_at + 1}-{total} {wrong} (one process's)"]
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

# ------------------------------------------------------------------------------------------- 07.reshard_load

RESHARD_HINTS = (
    "Reread lesson 07, section 4 'Resharding on load' and section 7 '4 -> 2'.",
    "get_state_dict and set_state_dict from torch.distributed.checkpoint.state_dict; "
    "torch.distributed.checkpoint.load with checkpoint_id.",
    "Ask the model and the optimizer for state dicts in their own layout (the keys and this rank's pieces), "
    "let DCP fill them in place from the folder under the same keys the save used, then hand them back to "
    "the model and the optimizer.",
)

STEPS = 2


def _reshard_label(outcome: RunOutcome, case: int) -> str:
    layout = outcome.inputs[case][0][1]
    saved = f"saved by {outcome.nproc} ranks, FSDP2"
    return (f"{saved}, loaded with each rank holding half of the rows ({outcome.nproc} ranks, a (2, "
            f"{outcome.nproc // 2}) mesh)" if layout == "halves" else f"{saved}, loaded into an unsharded model on every rank")


def _loaded(parts):
    def judge(outcome: RunOutcome) -> list[str]:
        _, want = one_process(STEPS)
        for case, by_rank in enumerate(outcome.results):
            for rank, result in sorted(by_rank.items()):
                out = result.output
                where = f"rank {rank}, {_reshard_label(outcome, case)}"
                if out["returned"] is not None:
                    return [f"{where}: the function returned a {out['returned']}; it loads in place and returns None"]
                wrong = _state_wrong(out["loaded"], want, parts)
                if wrong:
                    if parts[0] != "model" and not out["loaded"]["exp_avg"]:
                        wrong += ": the optimizer's state was not loaded"
                    return [f"{where}: after the load, {wrong} (one process after {STEPS} Adam steps)"]
        return []
    return judge


RESHARD_LOAD = Exercise(
    id="07.reshard_load",
    hints=RESHARD_HINTS,
    function="load_resharded",
    signature="load_resharded(model, optimizer, folder: str) -> None",
    driver="dcp_reshard_load",
    preload=DCP_PRELOAD,
    runs=(
        RunSpec(4, lambda n: [{r: (STEPS, "halves", "reshard_halves") for r in range(n)}],
                (Item("4 -> 2: the parameters equal one process after 2 steps (4 ranks)", 1, _loaded(("model",))),
                 Item("4 -> 2: Adam's moments and step counts equal one process's (4 ranks)", 1,
                      _loaded(("exp_avg", "exp_avg_sq", "steps")))),
                timeout_s=40),
        RunSpec(2, lambda n: [{r: (STEPS, "whole", "reshard_whole") for r in range(n)}],
                (Item("2 -> unsharded: the parameters equal one process after 2 steps (2 ranks)", 1,
                      _loaded(("model",))),
                 Item("2 -> unsharded: Adam's moments and step counts equal one process's (2 ranks)", 1,
                      _loaded(("exp_avg", "exp_avg_sq", "steps")))),
                timeout_s=30),
    ),
)

# ----------------------------------------------------------------------------------------- 07.crash_safe_save

CRASH_HINTS = (
    "Reread lesson 07, section 8 'Crashes: a rank killed in the middle of a save'.",
    "torch.distributed.checkpoint.save with checkpoint_id; dist.get_rank(); os.replace to swap a file in one step.",
    "Never write into a folder a restart might load: give every save a folder of its own, and only once the "
    "save has returned on every rank let one rank point LATEST at it, replacing the file in one step.",
)


def _latest_after_good_saves(outcome: RunOutcome) -> list[str]:
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            out = result.output
            for step in (1, 2):
                if out["named"][step] is None:
                    return [f"rank {rank}: after the save of step {step} returned on every rank, root/LATEST does "
                            "not exist; it must name the folder (under root) of the newest complete checkpoint"]
            if out["named"][1] == out["named"][2]:
                return [f"rank {rank}: the saves of step 1 and step 2 both went to {out['named'][1]!r}: the second "
                        "wrote over the first, the last good checkpoint while it was being written; give each save "
                        "a folder of its own"]
    return []


def _previous_survives(outcome: RunOutcome) -> list[str]:
    _, want = one_process(2)
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            out = result.output
            where = f"rank {rank}"
            if out["raised"] is None:
                return [f"{where}: the save of step 3 failed on rank 1 (its writer raised after writing its data), "
                        "but save_checkpoint returned normally: let the error propagate, the caller must know"]
            named = out["named"][3]
            if named is None:
                return [f"{where}: after the failed save of step 3, root/LATEST does not exist: a restart finds no "
                        "checkpoint at all"]
            if named != out["named"][2]:
                return [f"{where}: after the save of step 3 failed part-way, LATEST names {named!r}, not step 2's "
                        f"{out['named'][2]!r}: LATEST was written before the save had finished on every rank"
                        + (f"; loading it fails ({out['load_error']})" if out["load_error"] else "")]
            if out["load_error"]:
                return [f"{where}: after the failed save, loading {named!r} (what LATEST names) fails: "
                        f"{out['load_error']}"]
            wrong = _state_wrong(out["loaded"], want)
            if wrong:
                step3 = not _state_wrong(out["loaded"], out["after_3"], ("model",))
                why = (": it holds step 3's values, written over the checkpoint of step 2 by the save that failed; "
                       "give every save a folder of its own") if step3 else ""
                return [f"{where}: the checkpoint LATEST names after the failed save loads, but {wrong} "
                        f"(one process after 2 steps){why}"]
    return []


CRASH_SAFE = Exercise(
    id="07.crash_safe_save",
    hints=CRASH_HINTS,
    function="save_checkpoint",
    signature="save_checkpoint(state: dict, root: str, step: int) -> None",
    driver="dcp_crash_safe_save",
    preload=DCP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [{r: ("checkpoints",) for r in range(n)}],
                (Item("after each save, LATEST names a checkpoint of its own (2 ranks)", 1, _latest_after_good_saves),
                 Item("a save that fails part-way leaves LATEST naming step 2's checkpoint, which loads and equals "
                      "one process (2 ranks)", 2, _previous_survives)),
                timeout_s=30),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (APP_STATE, RESHARD_LOAD, CRASH_SAFE)}
