"""The markdown of a lesson's solution or exercise notebook, and its sections per exercise: shared by
the tests of every lesson's exercises (tests/test_0N_*.py)."""

from __future__ import annotations

import pathlib
import re

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def markdown_cells(folder: str, notebook: str) -> list[str]:
    """The markdown cells of `folder/notebook` ("solutions" or "exercises"), in order."""
    nb = nbformat.read(ROOT / folder / notebook, as_version=4)
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
