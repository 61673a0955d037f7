"""The markdown of a lesson's solution or exercise notebook, and its sections per exercise: shared by
the tests of every lesson's exercises (tests/test_0N_*.py)."""

from __future__ import annotations

import pathlib
import re

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def notebook_path(folder: str, notebook: str) -> pathlib.Path:
    """`solutions/NN_topic_solutions.ipynb` or `exercises/NN_topic_exercises.ipynb` from ("solutions", "NN_topic.ipynb"):
    the folder's suffix keeps a lesson and its exercises apart in JupyterLab's tabs."""
    stem = notebook.removesuffix(".ipynb")
    return ROOT / folder / f"{stem}_{folder}.ipynb"


def markdown_cells(folder: str, notebook: str) -> list[str]:
    """The markdown cells of `folder/notebook` ("solutions" or "exercises"), in order."""
    nb = nbformat.read(notebook_path(folder, notebook), as_version=4)
    return [cell.source for cell in nb.cells if cell.cell_type == "markdown"]


def exercise_sections(folder: str, notebook: str) -> dict[str, str]:
    """{exercise id: the markdown from its "## <id>: ..." heading to the next heading}."""
    sections, current = {}, None
    for text in markdown_cells(folder, notebook):
        heading = re.match(r"## (\S+):", text)
        if text.startswith("#"):
            current = heading.group(1) if heading else None
        if current:
            sections[current] = sections.get(current, "") + text + "\n"
    return sections


def assert_lists_exactly(folder: str, notebook: str, ids: list[str]) -> None:
    """`folder`'s notebook for lesson `notebook` holds one `%%exercise` cell per graded id, in the registry's
    order; its Goal list and its `## <id>:` sections name the same ids; its text names no exercise nobody
    grades; and it links the lesson it practises."""
    from course_lib.grading.cells import EXERCISE_ID, exercise_cells

    cells = exercise_cells(nbformat.read(notebook_path(folder, notebook), as_version=4))
    assert list(cells) == ids
    markdown = "\n".join(markdown_cells(folder, notebook))
    assert re.findall(r"^\d+\. `(\S+)`", markdown, re.M) == ids  # the list under Goal
    assert list(exercise_sections(folder, notebook)) == ids
    named = set(re.findall(rf"\b{EXERCISE_ID.pattern}\b", markdown))
    assert named <= set(ids), f"the text names exercises nobody grades: {sorted(named - set(ids))}"
    assert f"(../notebooks/{notebook})" in markdown  # the lesson it practises
