"""`%%exercise <id>` saves a learner's answer cell; `cl.check(id)` runs its public checks on it.

The cell is not run in the kernel: it is the module every rank of a check
loads (the ranks cannot receive notebook functions, see lesson 00). Saving
only compiles it, so a syntax error is reported at once, in one line.
"""

from __future__ import annotations

import ast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from ..magic_args import RankFailure
from .cells import parse_exercise_line, remember, remembered
from .checker import ItemResult, check_exercise, submission_source
from .registry import UnknownExercise, exercise
from .report import item_line, score_text

__all__ = ["CheckReport", "ExerciseMagics", "check"]


class CheckError(RankFailure):
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
        raise CheckError(f"{exercise_id}: run its %%exercise {exercise_id} cell first (it saves your answer)")
    sizes = sorted({run.nproc for run in found.runs})
    runs = f"{len(found.runs)} run{'s' if len(found.runs) != 1 else ''}"
    print(f"{exercise_id}: {runs} on real ranks (gloo, {' and '.join(map(str, sizes))} ranks)", flush=True)
    items = check_exercise(found, source, on_item=lambda item: print(item_line(item), flush=True))
    report = CheckReport(exercise_id, items)
    verdict = "all checks pass" if report.passed else "not yet"
    print(f"{exercise_id}: {score_text(report.score, report.max_score)} points, {verdict}")
    return report


def _defines(source: str, function: str) -> bool:
    tree = ast.parse(source)
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
               for node in tree.body)


@magics_class
class ExerciseMagics(Magics):
    @cell_magic
    def exercise(self, line: str, cell: str):
        """`%%exercise 01.ring_allreduce`: save this cell as your answer (see module docstring)."""
        exercise_id = parse_exercise_line(f"%%exercise {line}")
        if exercise_id is None:
            raise UsageError(f"%%exercise: expected one exercise id like 01.ring_allreduce, got {line.strip()!r}")
        try:
            found = exercise(exercise_id)
        except UnknownExercise as exc:
            raise UsageError(f"%%exercise: {exc}") from None
        full = f"%%exercise {line.strip()}\n{cell}"
        try:
            compile(submission_source(full), "<cell>", "exec")
        except SyntaxError as exc:
            raise UsageError(f"%%exercise: the cell does not parse: line {exc.lineno}: {exc.msg}") from None
        remember(exercise_id, full)
        if not _defines(cell, found.function):
            print(f"saved {exercise_id}, but the cell defines no function {found.function} yet: "
                  f"write {found.signature}")
            return
        print(f"saved {exercise_id}: {found.signature}; check it with cl.check({exercise_id!r})")
