"""`cl.check(id)`: run an exercise's public checks on the learner's last `%%exercise` cell, printing each result.

A check of the untouched stub (every item failed on its NotImplementedError) prints one "not written
yet" line instead of the same reason on every item, and uses up no hint level: nothing was tried yet.
"""

from __future__ import annotations

import re

from ..errors import OneLineError
from .cells import remembered
from .checker import check_exercise, not_written_yet
from .registry import UnknownExercise, exercise
from .report import hint_line, item_line, score_text, wrapped
from .spec import ItemResult

__all__ = ["CheckError", "CheckReport", "check"]


_failed_checks: dict[str, int] = {}  # exercise id -> checks of it that failed in this kernel
_STUB_AT = re.compile(r" at cell line (\d+):")


class _ItemPrinter:
    """Prints each item as it is judged, holding back those that failed on the stub while every item so far did."""

    def __init__(self, stub_reason: str):
        self.stub_reason = stub_reason
        self.held: list[ItemResult] = []
        self.printing = False

    def add(self, item: ItemResult) -> None:
        if not self.printing and not item.passed and item.message.endswith(self.stub_reason):
            self.held.append(item)
            return
        if not self.printing:  # part of the answer is written: every item counts, in order
            self.printing = True
            for held in self.held:
                print(item_line(held), flush=True)
            self.held = []
        print(item_line(item), flush=True)


class CheckError(OneLineError):
    """A one-line error in the notebook (no traceback), e.g. checking an exercise never saved."""


class CheckReport:
    """What `cl.check` found. It was printed as the checks ran, so it displays as nothing."""

    def __init__(self, exercise_id: str, items: list[ItemResult]):
        self.exercise_id, self.items = exercise_id, items
        self.score = sum(i.score for i in items)
        self.max_score = sum(i.max_score for i in items)

    @property
    def passed(self) -> bool:
        return self.score == self.max_score

    def _ipython_display_(self) -> None:
        pass  # already printed line by line; showing it again as Out[n] would repeat it

    def __repr__(self) -> str:
        return f"CheckReport({self.exercise_id}: {score_text(self.score, self.max_score)})"


def check(exercise_id: str) -> CheckReport:
    """Run the public checks of `exercise_id` on its last saved `%%exercise` cell, printing each result."""
    try:
        found = exercise(exercise_id)
    except UnknownExercise as exc:
        raise CheckError(str(exc)) from None
    source = remembered(exercise_id)
    if source is None:
        # Before any rank starts: nothing ran, so this is not a rank's failure (RankFailure) but a step missed.
        raise CheckError(f"{exercise_id}: no answer saved in this kernel yet: run the cell that starts with "
                         f"%%exercise {exercise_id} first (running it saves your answer)")
    sizes = sorted({run.nproc for run in found.runs})
    runs = f"{len(found.runs)} run{'s' if len(found.runs) != 1 else ''}"
    print(f"{exercise_id}: {runs} on real ranks (gloo, {' and '.join(map(str, sizes))} ranks)", flush=True)
    printer = _ItemPrinter(not_written_yet(exercise_id))
    items = check_exercise(found, source, on_item=printer.add)
    report = CheckReport(exercise_id, items)
    if items and len(printer.held) == len(items):
        where = _STUB_AT.search(items[0].message)
        at = f" at cell line {where.group(1)}" if where else ""
        print(wrapped(f"{exercise_id}: not written yet (its stub raised NotImplementedError{at}), so nothing was "
                      f"checked: {score_text(report.score, report.max_score)} points; write it, run its cell, then "
                      "check again", "", "    "))
        return report
    verdict = "all checks pass" if report.passed else "not yet"
    print(f"{exercise_id}: {score_text(report.score, report.max_score)} points, {verdict}")
    if not report.passed and found.hints:
        # One level more after each failed check of this kernel: section, then API, then approach.
        print(hint_line(found.hints, _failed_checks.get(exercise_id, 0)))
        _failed_checks[exercise_id] = _failed_checks.get(exercise_id, 0) + 1
    return report
