"""07.crash_safe_save: a save that fails part-way leaves LATEST naming the previous, complete checkpoint.

Judged: a folder per save, LATEST replaced in one step (a new file each save, not rewritten in place: told apart with
os.path.samestat against the previous LATEST held open, not by inode numbers, which ext4 reuses at once), the
failed save raising, and the checkpoint LATEST names after it loading and equal to one process.
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import DCP_PRELOAD, one_process, state_wrong

__all__ = ["CRASH_SAFE"]

CRASH_HINTS = (
    "Reread lesson 07, section 8 'Crashes: a rank killed in the middle of a save'.",
    "torch.distributed.checkpoint.save with checkpoint_id; dist.get_rank(); os.replace to swap a file in one step.",
    "Never write into a folder a restart might load: give every save a folder of its own, and only once the "
    "save has returned on every rank let one rank point LATEST at it, replacing the file in one step.",
)


def _latest_after_good_saves(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        out = result.output
        for step in (1, 2):
            if out["named"][step] is None:
                return [f"rank {rank}: after the save of step {step} returned on every rank, root/LATEST does "
                        "not exist; it must name the folder (under root) of the newest complete checkpoint"]
        if out["named"][1] == out["named"][2]:
            return [f"rank {rank}: the saves of step 1 and step 2 both went to {out['named'][1]!r}: the second "
                    "wrote over the first, the last good checkpoint while it was being written; give each save "
                    "a folder of its own"]
        if out["replaced"] and not out["replaced"][0]:
            return [f"rank {rank}: after the save of step 2, LATEST is the same file as after step 1, rewritten "
                    "in place: a crash while it is being written leaves it empty or half written; write a "
                    "temporary file and os.replace it onto LATEST (one step: old or new, never half)"]
    return []


def _previous_survives(outcome: RunOutcome) -> list[str]:
    _, want = one_process(2)
    for case, rank, result in each_result(outcome):
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
        wrong = state_wrong(out["loaded"], want)
        if wrong:
            step3 = not state_wrong(out["loaded"], out["after_3"], ("model",))
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
                (Item("after each save, LATEST names a checkpoint of its own and was replaced in one step (2 ranks)", 1, _latest_after_good_saves),
                 Item("a save that fails part-way leaves LATEST naming step 2's checkpoint, which loads and equals "
                      "one process (2 ranks)", 2, _previous_survives)),
                timeout_s=30),
    ),
)
