"""07.crash_safe_save: the newest `keep` complete checkpoints kept, and a save that fails part-way leaves LATEST
naming the previous, complete one.

Judged: a folder per save and LATEST replaced in one step (a new file each save, not rewritten in place: told
apart with os.path.samestat against the previous LATEST held open, not by inode numbers, which ext4 reuses at
once); after each good save, the folders under root are exactly the newest `keep` complete checkpoints (by step,
`.metadata` present); the failed save raising, deleting nothing, and the checkpoint LATEST names after it
loading and equal to one process.
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import DCP_PRELOAD, one_process, state_wrong
from .drivers import FAILED_SAVE, GOOD_SAVES, LAST_SAVE

__all__ = ["CRASH_SAFE"]

KEEP = 2
CRASH_HINTS = (
    "Reread lesson 07, section 8 'Crashes: a rank killed in the middle of a save' (its rule 3 on older folders) "
    "and section 5 on what DCP writes last.",
    "torch.distributed.checkpoint.save with checkpoint_id; dist.get_rank(); os.replace to swap a file in one "
    "step; os.scandir / os.path.exists to see which folders hold a .metadata; shutil.rmtree.",
    "Give every save a folder of its own; once the save has returned, one rank points LATEST at it (a temporary "
    "file replaced onto LATEST) and only then deletes what is neither among the newest `keep` complete "
    "checkpoints (those with a .metadata, ordered by their step number) nor LATEST's.",
)
GOOD = (*GOOD_SAVES, LAST_SAVE)


def _relative(name: str, root: str) -> str:
    """What LATEST names, relative to root: a name that repeats root's path (item 1 fails it) still tells item 2
    which folder that save wrote."""
    prefix = root.rstrip("/") + "/"
    return name[len(prefix):] if name.startswith(prefix) else name


def _expected(out: dict, step: int, root: str) -> list[str]:
    """The newest KEEP good saves up to `step`: the folders LATEST named after each."""
    steps = [s for s in GOOD if s <= step]
    return sorted({_relative(out["named"][s], root) for s in steps[-KEEP:]})


def _not_under_root(out: dict, step: int, root: str) -> str:
    """Why LATEST's name is no folder under root, in words ("" if it is one)."""
    if out["under_root"].get(step, True):
        return ""
    named = out["named"][step]
    said = (f"LATEST holds {named!r}, and {root}/{named} is no folder: a restart reads LATEST relative to root, "
            "so it must name the folder as seen from root")
    if _relative(named, root) != named:
        said += f" ({_relative(named, root)!r}, not the path you passed to dcp.save)"
    return said


def _own_folder_replaced(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        out = result.output
        for step in GOOD:
            if out["named"].get(step) is None:
                return [f"rank {rank}: after the save of step {step} returned on every rank, root/LATEST does not "
                        "exist; it must name the folder (under root) of the newest complete checkpoint"]
        root = outcome.inputs[case][rank][0]
        for step in GOOD:
            wrong = _not_under_root(out, step, root)
            if wrong:
                return [f"rank {rank}: after the save of step {step}, {wrong}"]
        names = [out["named"][s] for s in GOOD]
        if len(set(names)) < len(names):
            return [f"rank {rank}: the saves of steps {', '.join(map(str, GOOD))} went to {names}: a later save "
                    "wrote over an earlier one, the last good checkpoint while it was being written; give each "
                    "save a folder of its own"]
        for step in GOOD[1:]:
            if step != LAST_SAVE and not out["replaced"].get(step, True):
                return [f"rank {rank}: after the save of step {step}, LATEST is the same file as after the save "
                        "before, rewritten in place: a crash while it is being written leaves it empty or half "
                        "written; write a temporary file and os.replace it onto LATEST (one step: old or new)"]
    return []


def _keeps_newest_complete(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        out = result.output
        if out["last_error"]:
            return [f"rank {rank}: the save of step {LAST_SAVE}, after the failed one, raised: {out['last_error']}"]
        root = outcome.inputs[case][rank][0]
        for step in GOOD:
            held, want = out["folders"][step], _expected(out, step, root)
            if sorted(held) == want:
                continue
            gone = [name for name in want if name not in held]
            extra = sorted(name for name in held if name not in want)
            said = (f"rank {rank}: after the save of step {step} (keep={KEEP}), root holds {sorted(held)}, "
                    f"expected the newest {KEEP} complete checkpoints {want}")
            if _relative(out["named"][step], root) in gone:
                return [f"{said}: the folder LATEST names was deleted; order the folders by their step number, "
                        "not by their name (as text 'step_10' < 'step_9')"]
            if gone and any(not held[name] for name in extra):
                return [f"{said}: {[n for n in extra if not held[n]]} has no .metadata (the failed save's) and was "
                        f"counted as a checkpoint, so {gone} was deleted; count only complete ones"]
            if gone:
                return [f"{said}: {gone} was deleted"]
            return [f"{said}: {extra} should have been deleted"
                    + (" (no .metadata: the failed save's)" if any(not held[n] for n in extra) else "")]
    return []


def _previous_survives(outcome: RunOutcome) -> list[str]:
    last_good = GOOD_SAVES[-1]
    _, want = one_process(last_good)
    for case, rank, result in each_result(outcome):
        out = result.output
        where = f"rank {rank}"
        if out["raised"] is None:
            return [f"{where}: the save of step {FAILED_SAVE} failed on rank 1 (its writer raised after writing its "
                    "data), but save_checkpoint returned normally: let the error propagate, the caller must know"]
        named = out["named"][FAILED_SAVE]
        if named is None:
            return [f"{where}: after the failed save of step {FAILED_SAVE}, root/LATEST does not exist: a restart "
                    "finds no checkpoint at all"]
        if named != out["named"][last_good]:
            return [f"{where}: after the save of step {FAILED_SAVE} failed part-way, LATEST names {named!r}, not "
                    f"step {last_good}'s {out['named'][last_good]!r}: LATEST was written before the save had "
                    "finished on every rank"
                    + (f"; loading it fails ({out['load_error']})" if out["load_error"] else "")]
        root = outcome.inputs[case][rank][0]
        if _not_under_root(out, FAILED_SAVE, root):
            return [f"{where}: after the failed save, a restart finds no checkpoint: "
                    f"{_not_under_root(out, FAILED_SAVE, root)}"]
        if out["load_error"]:
            return [f"{where}: after the failed save, loading {named!r} (what LATEST names) fails: "
                    f"{out['load_error']}"]
        kept = [n for n in _expected(out, last_good, root) if not out["folders"][FAILED_SAVE].get(n)]
        if kept:
            return [f"{where}: after the failed save of step {FAILED_SAVE}, {kept} (among the newest {KEEP} "
                    "complete checkpoints before it) is gone or incomplete: a save may delete old checkpoints "
                    "only once it is complete itself"]
        wrong = state_wrong(out["loaded"], want)
        if wrong:
            overwritten = not state_wrong(out["loaded"], out["after_failed"], ("model",))
            why = (f": it holds step {FAILED_SAVE}'s values, written over the checkpoint of step {last_good} by the "
                   "save that failed; give every save a folder of its own") if overwritten else ""
            return [f"{where}: the checkpoint LATEST names after the failed save loads, but {wrong} "
                    f"(one process after {last_good} steps){why}"]
    return []


CRASH_SAFE = Exercise(
    id="07.crash_safe_save",
    hints=CRASH_HINTS,
    function="save_checkpoint",
    signature="save_checkpoint(state: dict, root: str, step: int, keep: int) -> None",
    driver="dcp_crash_safe_save",
    preload=DCP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [{r: ("checkpoints", KEEP) for r in range(n)}],
                (Item("after each save, LATEST names a checkpoint of its own and was replaced in one step (2 ranks)",
                      1, _own_folder_replaced),
                 Item(f"after each good save, root holds exactly the newest {KEEP} complete checkpoints (2 ranks)", 1,
                      _keeps_newest_complete),
                 Item(f"a save that fails part-way deletes nothing and leaves LATEST naming step "
                      f"{GOOD_SAVES[-1]}'s checkpoint, which loads and equals one process (2 ranks)", 2,
                      _previous_survives)),
                timeout_s=45),
    ),
)
