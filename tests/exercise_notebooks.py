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
