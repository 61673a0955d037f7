"""The rules every stored notebook keeps (README, "Writing a lesson"), checked on the files as committed.

What a learner sees first is the stored output: no absolute paths, no empty
placeholders, no widget that can only say "model not found". And each lesson
stays within its budget: at most 50 cells and 8 `cl.*` names.
"""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STORED = sorted(p for folder in ("notebooks", "solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb"))
LESSONS = sorted(p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb") if "appendix" not in p.name)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
MAX_CELLS = 50
MAX_CL_NAMES = 8

# A path of this machine: a home, a checkout, a venv, a temporary folder, or a Windows drive.
ABSOLUTE_PATH = re.compile(r"(?<![\w.<])(?:/(?:home|Users|work|tmp|usr|opt|root|var|private|srv|mnt)/|[A-Za-z]:\\)")
# A learner's prediction ("Predict, then measure"), and the line where the lesson leaves it blank.
PREDICTION = re.compile(r"\bmy_\w*prediction\w*")
PREDICTION_LEFT_BLANK = re.compile(r"^my_\w*prediction\w*\s*=\s*None\b", re.M)


def _outputs(nb):
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            yield index, output


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    return "".join(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))


def test_the_checks_find_what_they_look_for():
    # The patterns themselves: a path the old lesson 00 stored, and what must not match.
    assert ABSOLUTE_PATH.search('File "/work/main/.venv/lib/python3.11/site-packages/torch/x.py"')
    assert ABSOLUTE_PATH.search(r"C:\Users\me\course")
    assert not ABSOLUTE_PATH.search('File "torch/distributed/distributed_c10d.py", line N')
    assert not ABSOLUTE_PATH.search("<site-packages>/torch/ and 4/8 ranks and tcp://localhost:1234/x")
    blank, check = "my_prediction_mib = None   # e.g. 1.0", "if my_rank2_prediction is None:"
    assert len(PREDICTION.findall(blank)) == len(PREDICTION_LEFT_BLANK.findall(blank)) == 1
    assert PREDICTION.findall(check) == ["my_rank2_prediction"] and not PREDICTION_LEFT_BLANK.findall(check)


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_outputs_show_no_absolute_path(path):
    nb = nbformat.read(path, as_version=4)
    found = [(i, m.group(0)) for i, out in _outputs(nb) for m in ABSOLUTE_PATH.finditer(_text(out))]
    assert not found, f"cells with an absolute path in their output: {found}"


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_outputs_have_no_empty_placeholder(path):
    nb = nbformat.read(path, as_version=4)
    empty = [i for i, out in _outputs(nb) if out.output_type != "error"
             and not _text(out).strip() and not any(k.startswith("image/") for k in out.get("data", {}))]
    assert not empty, f"cells with an empty output (a live view or display left behind): {empty}"


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_stored_widget_can_be_shown_without_its_kernel(path):
    """JupyterLab renders a stored widget from the notebook's saved widget state; without it,
    a trusted notebook shows "model not found". The PNG serves front-ends with no widget manager."""
    nb = nbformat.read(path, as_version=4)
    saved = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for index, out in _outputs(nb):
        view = out.get("data", {}).get(WIDGET_VIEW)
        if view is None:
            continue
        assert "image/png" in out.data, f"cell {index}: a widget without a static PNG"
        assert view["model_id"] in saved, f"cell {index}: widget {view['model_id']} has no saved state"


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_notebook_carries_widget_state_it_does_not_show(path):
    """Saved widget state another notebook left (lesson 01's, 72 KB, once sat in 02 and 03) makes
    JupyterLab open the notebook as changed, and weighs on every diff."""
    nb = nbformat.read(path, as_version=4)
    saved = set(nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {}))
    shown = [out.data[WIDGET_VIEW]["model_id"] for _, out in _outputs(nb) if WIDGET_VIEW in out.get("data", {})]
    assert not saved or shown, f"{len(saved)} saved widget models and no widget shown"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_within_budget(path):
    nb = nbformat.read(path, as_version=4)
    assert len(nb.cells) <= MAX_CELLS, f"{len(nb.cells)} cells"
    names = set(re.findall(r"\bcl\.([A-Za-z_]\w*)", "\n".join(c.source for c in nb.cells if c.cell_type == "code")))
    assert len(names) <= MAX_CL_NAMES, sorted(names)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for part in ("**Goal.**", "## Summary", "## Exercises"):
        assert part in text, f"no {part!r}"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_outputs_that_answer_a_prediction_are_stored_collapsed(path):
    """A learner sees the stored outputs before predicting: a cell that reads a prediction (other than
    leaving it blank) prints the answer, so its output is stored collapsed (`jupyter.outputs_hidden`).
    JupyterLab then shows a bar with the output's first line, which must not give the answer (checked,
    with the cells below a reveal that read its run's results, by tests/test_think_first.py), until the
    learner clicks it or runs the cell. nbval still compares the output."""
    nb = nbformat.read(path, as_version=4)
    # A reveal cell (`%reveal`) stores only the line asking for a prediction: tests/test_think_first.py.
    shown = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.outputs
             and len(PREDICTION.findall(cell.source)) > len(PREDICTION_LEFT_BLANK.findall(cell.source))
             and "reveal" not in cell.metadata.get("tags", [])
             and not cell.metadata.get("jupyter", {}).get("outputs_hidden")]
    assert not shown, f"cells that read a prediction and show the answer in their stored output: {shown}"


@pytest.mark.parametrize("path", STORED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kernel_named_as_jupyterlab_names_it(path):
    """JupyterLab rewrites any other display name when the kernel starts, so the notebook opens as changed."""
    spec = nbformat.read(path, as_version=4).metadata.kernelspec
    assert (spec.name, spec.display_name) == ("python3", "Python 3 (ipykernel)")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_lists_exactly_the_exercises_graded(path):
    """The ids a lesson's "## Exercises" section names are the ones the grader checks, in its order."""
    from course_lib.grading.registry import exercises_of_lesson

    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    section = text.split("## Exercises", 1)[1]
    lesson = path.name[:2]
    named = list(dict.fromkeys(re.findall(rf"`({lesson}\.[a-z0-9_]+)`", section)))
    assert named == exercises_of_lesson(lesson)
