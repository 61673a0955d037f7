"""The learner's answers: `%%exercise <id>` cells, from a notebook file or from this kernel."""

from __future__ import annotations

import re

__all__ = ["EXERCISE_ID", "EXERCISE_LINE", "exercise_cells", "parse_exercise_line", "remember", "remembered",
           "is_stub_error", "stub_message", "MAX_STUB_MESSAGE", "STUB_TEXT"]

EXERCISE_ID = re.compile(r"\d\d\.[a-z0-9_]+")  # lesson number, a dot, a name: 01.ring_allreduce
EXERCISE_LINE = re.compile(rf"^%%exercise\s+({EXERCISE_ID.pattern})\s*$")

_remembered: dict[str, str] = {}  # id -> source of the last %%exercise cell run in this kernel


def parse_exercise_line(first_line: str) -> str | None:
    """The id on a `%%exercise <id>` line, or None."""
    match = EXERCISE_LINE.match(first_line.strip())
    return match.group(1) if match else None


def exercise_cells(nb) -> dict[str, str]:
    """{id: whole cell source, magic line included} of a notebook (nbformat NotebookNode).

    If a learner has two cells for one id, the last one counts, as it would
    if they ran the notebook from top to bottom.
    """
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        exercise_id = parse_exercise_line(source.split("\n", 1)[0])
        if exercise_id:
            found[exercise_id] = source
    return found


STUB_TEXT = "your code here"
MAX_STUB_MESSAGE = 62  # characters: room for the id and STUB_TEXT, none for a recipe


def stub_message(exercise_id: str) -> str:
    """What an exercise notebook's stub raises: `NotImplementedError("01.ring_allreduce: your code here")`.

    It holds no hint: hints come from the check, after a failure (Exercise.hints)."""
    return f"{exercise_id}: {STUB_TEXT}"


def is_stub_error(error_line: str, exercise_id: str) -> bool:
    """Whether the last line of a traceback is the stub's, "NotImplementedError: <id>: your code here"."""
    return error_line.strip() == f"NotImplementedError: {stub_message(exercise_id)}"


def remember(exercise_id: str, source: str) -> None:
    _remembered[exercise_id] = source


def remembered(exercise_id: str) -> str | None:
    return _remembered.get(exercise_id)
