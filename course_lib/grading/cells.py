"""The learner's answers: `%%exercise <id>` cells, from a notebook file or from this kernel."""

from __future__ import annotations

import re

__all__ = ["EXERCISE_ID", "EXERCISE_LINE", "exercise_cells", "parse_exercise_line", "remember", "remembered",
           "stub_hint", "stub_message"]

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


def stub_message(exercise_id: str, hint: str) -> str:
    """What an exercise notebook's stub raises: `NotImplementedError("01.ring_allreduce: <hint>")` (authoring.py)."""
    return f"{exercise_id}: {hint}"


def stub_hint(error_line: str, exercise_id: str) -> str | None:
    """The hint in the last line of a stub's traceback, "NotImplementedError: <id>: <hint>"; None for any other error."""
    prefix = f"NotImplementedError: {stub_message(exercise_id, '')}"
    if not error_line.startswith(prefix):
        return None
    return error_line[len(prefix):].strip() or None


def remember(exercise_id: str, source: str) -> None:
    _remembered[exercise_id] = source


def remembered(exercise_id: str) -> str | None:
    return _remembered.get(exercise_id)
