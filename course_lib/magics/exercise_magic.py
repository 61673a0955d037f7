"""`%%exercise <id>` saves a learner's answer cell; `cl.check(id)` (grading/check.py) then checks it.

The cell is not run in the kernel: it is the module every rank of a check
loads (the ranks cannot receive notebook functions, see lesson 00). Saving
only compiles it, so a syntax error is reported at once, in one line.
"""

from __future__ import annotations

import ast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from ..grading.cells import parse_exercise_line, remember
from ..grading.checker import submission_source
from ..grading.registry import UnknownExercise, exercise

__all__ = ["ExerciseMagics"]


def _defines(source: str, function: str) -> bool:
    """Whether the cell defines `function` at its top level: a function, or a class (03.counting_joinable)."""
    tree = ast.parse(source)
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == function
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
            kind = "class" if found.signature.startswith("class ") else "function"
            print(f"saved {exercise_id}, but the cell defines no {kind} {found.function} yet: "
                  f"write {found.signature}")
            return
        print(f"saved {exercise_id}: {found.signature}; check it with cl.check({exercise_id!r})")
