"""Learners think before they see: stubs hold no recipe, hints come from the check, predictions hide their answers.

Fast, single-process, over the committed notebooks and the exercise specs:
- every exercise stub's message is at most 62 characters (`<id>: your code here`);
- no line of a solution's answer appears in its exercise notebook's markdown or stub messages;
- every exercise has three hints (section, API, approach) and none holds a line of its answer;
- each lesson has its reveal cells (at least 2 in lessons 01-03, 4 in 04-05), each `%reveal <id>` of one
  of its own predictions, after a cell that sets the prediction to None, and none stores a number;
- no other stored output gives a reveal's answer away before the learner has predicted (every lesson, any
  number): a cell below a reveal that reads what its run published (`results["<name>"]`, for the prediction's
  `needs` and every `cl.publish` name of the cells between the blank prediction and the reveal) is stored collapsed,
  and the answer's values (as `make notebooks` recorded them in tests/reveal_answers/) appear in no shown
  output and in no collapsed output's first line, the line JupyterLab shows on the collapsed bar.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from course_lib.grading.cells import MAX_STUB_MESSAGE, exercise_cells
from course_lib.grading.registry import exercises_of_lesson, public_exercises
from course_lib.predictions import all_predictions
from course_lib.predictions.reveal import ANSWERS_ENV, RevealError, record_answer, reveal, write_first

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10")  # with exercises
REVEAL_LESSONS = LESSONS  # lessons with predictions
MIN_REVEALS = {"01": 2, "02": 2, "03": 2, "04": 4, "05": 4, "06": 3, "07": 3, "08": 3, "09": 3, "10": 3}
NEW_EXERCISES = ("02.ddp_from_scratch", "03.zero1_by_hand", "04.memory_per_rank", "05.zero3_linear", "05.hsdp_mesh",
                 "06.sp_mlp", "06.vocab_embedding", "06.vocab_cross_entropy", "07.crash_safe_save", "08.gpipe",
                 "08.one_f_one_b", "08.balance", "09.ring_online", "09.ring_backward", "09.zigzag")
STUB = re.compile(r"""NotImplementedError\((["'])(.*?)\1\)""")
# A number a learner could read: two digits or more, or a digit next to a decimal point/thousands comma.
NUMBER = re.compile(r"\d[\d,_.]*\d")
# "cell 3", "section 5", "lesson 04" point somewhere; they are not answers.
POINTER = re.compile(r"(?i)\b(cells?|sections?|lessons?|§)\s*\d+")
ANSWERS = ROOT / "tests" / "reveal_answers"  # lessonNN.json: {prediction id: [values]}, written by `make notebooks`
REVEAL_LINE = re.compile(r"^\s*%reveal\s+(\S+)", re.M)


def _cells(path: pathlib.Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _notebook(folder: str, lesson: str) -> pathlib.Path:
    (path,) = [p for p in sorted((ROOT / folder).glob(f"{lesson}_*.ipynb")) if "_appendix_" not in p.name]
    return path


def _answer_lines(solution: pathlib.Path) -> list[str]:
    """The lines inside the solution's BEGIN/END SOLUTION regions that say something (12+ characters)."""
    lines, inside = [], False
    for cell in _cells(solution):
        for line in _source(cell).splitlines():
            text = line.strip()
            if text == "### BEGIN SOLUTION":
                inside = True
            elif text == "### END SOLUTION":
                inside = False
            elif inside and len(text.lstrip("#").strip()) >= 12:
                lines.append(text.lstrip("#").strip())
    return lines


def _text_outputs(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        for mime, value in output.get("data", {}).items():
            if mime.startswith("text/"):
                parts.append("".join(value) if isinstance(value, list) else str(value))
    return "".join(parts)


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_stub_message_is_short_and_tells_no_recipe(lesson):
    exercises = _notebook("exercises", lesson)
    messages = [m.group(2) for cell in _cells(exercises) for m in STUB.finditer(_source(cell))]
    assert messages, f"{exercises.name} has no stubs"
    for message in messages:
        assert len(message) <= MAX_STUB_MESSAGE and message.endswith(": your code here"), message


@pytest.mark.parametrize("lesson", LESSONS)
def test_no_line_of_an_answer_appears_in_the_exercise_notebooks_markdown_or_stubs(lesson):
    exercises = _notebook("exercises", lesson)
    shown = "\n".join(_source(c) for c in _cells(exercises) if c["cell_type"] == "markdown")
    shown += "\n".join(m.group(2) for c in _cells(exercises) for m in STUB.finditer(_source(c)))
    leaked = [line for line in _answer_lines(_notebook("solutions", lesson)) if line in shown]
    assert not leaked, f"{exercises.name} shows lines of the answer: {leaked[:3]}"


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_exercise_has_three_hints_none_holding_its_answer(lesson):
    answer = _answer_lines(_notebook("solutions", lesson))
    for exercise_id in exercises_of_lesson(lesson):
        hints = public_exercises()[exercise_id].hints
        assert len(hints) == 3 and all(h.strip() for h in hints), f"{exercise_id}: {hints!r}"
        leaked = [line for line in answer if any(line in hint for hint in hints)]
        assert not leaked, f"{exercise_id}'s hints hold its answer: {leaked[:2]}"


def test_the_build_it_yourself_exercises_exist_and_have_their_cells():
    known = public_exercises()
    for exercise_id in NEW_EXERCISES:
        assert exercise_id in known, exercise_id
        cells = exercise_cells(_nb(_notebook("solutions", exercise_id[:2])))
        assert exercise_id in cells, f"no %%exercise {exercise_id} cell in solutions/"
    assert "02.average_gradients" not in known  # replaced by 02.ddp_from_scratch
    assert not {"06.megatron_mlp", "06.attention_plan", "06.mesh_2d"} & set(known)  # copies of lesson 06's cells


def _nb(path: pathlib.Path):
    import nbformat

    return nbformat.read(path, as_version=4)


def _reveal_cells(lesson: str) -> list[tuple[int, dict]]:
    cells = _cells(_notebook("notebooks", lesson))
    return [(i, c) for i, c in enumerate(cells) if "reveal" in c.get("metadata", {}).get("tags", [])]


@pytest.mark.parametrize("lesson", REVEAL_LESSONS)
def test_each_lesson_has_its_reveal_cells_and_none_stores_a_number(lesson):
    cells = _cells(_notebook("notebooks", lesson))
    reveals = _reveal_cells(lesson)
    assert len(reveals) >= MIN_REVEALS[lesson], f"lesson {lesson}: {len(reveals)} reveal cells"
    used = []
    for index, cell in reveals:
        lines = [ln for ln in _source(cell).splitlines() if ln.strip() and not ln.strip().startswith("#")]
        assert len(lines) == 1 and lines[0].startswith("%reveal "), f"cell {index}: {_source(cell)!r}"
        words = lines[0].split()
        prediction_id, variable = words[1], (words[2] if len(words) > 2 else "my_prediction")
        assert prediction_id in all_predictions() and prediction_id.startswith(f"{lesson}."), prediction_id
        used.append(prediction_id)
        above = "\n".join(_source(c) for c in cells[:index] if c["cell_type"] == "code")
        assert re.search(rf"^{variable}\s*=\s*None\b", above, re.M), f"cell {index}: no `{variable} = None` above"
        stored = POINTER.sub("", _text_outputs(cell))
        assert stored.strip(), f"cell {index} stores no output (run it: it says where to write the prediction)"
        assert not NUMBER.search(stored), f"cell {index} stores a number: {stored!r}"
    assert sorted(used) == sorted(p for p in all_predictions() if p.startswith(f"{lesson}.")), \
        "every prediction of the lesson is revealed exactly once"


# ---------------------------------------------------------------- no stored output gives a reveal's answer away


def _collapsed(cell: dict) -> bool:
    return bool(cell.get("metadata", {}).get("jupyter", {}).get("outputs_hidden"))


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), "")


def _number(value) -> str | None:
    """A regex for one number of an answer as the reveal shows it (`132,096`) or as a cell may print it
    (`132096`, `12.0`), as a whole number; None for a one-digit number, which matches too much to search
    for (the collapse rule covers answers made of those)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if float(value).is_integer() and abs(value) < 10:
        return None
    forms = {f"{value:,.6g}", f"{value:.6g}", repr(value)}
    if float(value).is_integer():
        forms |= {f"{int(value):,}", str(int(value)), f"{float(value)}"}
    body = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return rf"(?<![\d.,])(?:{body})(?![\d]|[.,]\d)"


def _answer_pattern(values: list) -> re.Pattern | None:
    """The answer's searchable numbers in order, with no other number between them on one line (a tuple
    printed as the reveal would, `[2, 12, 22, 32]`; a row of the input grid that holds one of them is not
    it). None when no number of the answer can be searched for."""
    numbers = [n for n in map(_number, values) if n]
    return re.compile(r"[^\d\n]*?".join(numbers)) if numbers else None


def _answer_line(text: str, pattern: re.Pattern | None) -> str | None:
    """The first line of `text` that shows the answer."""
    if pattern is None:
        return None
    return next((line for line in text.splitlines() if pattern.search(line)), None)


def _recorded_answers(lesson: str) -> dict:
    path = ANSWERS / f"lesson{lesson}.json"
    return json.loads(path.read_text()) if path.exists() else {}


PUBLISH = re.compile(r"""\bpublish\(\s*["'](\w+)["']""")


def _published_for(cells: list[dict], reveal_index: int) -> set[str]:
    """The `cl.publish` names of the run a reveal measures: those of the code cells between the cell that
    leaves the prediction blank (`... = None`) and the reveal."""
    blank = max((i for i in range(reveal_index) if cells[i]["cell_type"] == "code"
                 and re.search(r"^\w+\s*=\s*None\b", _source(cells[i]), re.M)), default=reveal_index)
    return {name for cell in cells[blank:reveal_index] if cell["cell_type"] == "code"
            for name in PUBLISH.findall(_source(cell))}


REVEALING = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", REVEALING, ids=lambda p: p.name)
def test_no_stored_output_gives_a_reveals_answer_away(path):
    """README, "Predict, then measure": a learner reads the stored outputs before predicting. Below each
    `%reveal NN.name`, a cell that reads what the prediction's run published prints the answer, so its
    output is stored collapsed; and the answer's values, printed above the reveal or in the rest of its
    section, are in no output left open and in no collapsed output's first line (JupyterLab shows that line
    on the collapsed bar)."""
    cells = _cells(path)
    reveals = [(i, m.group(1)) for i, c in enumerate(cells) if c["cell_type"] == "code"
               for m in [REVEAL_LINE.search(_source(c))] if m]
    problems = []
    for index, prediction_id in reveals:
        spec = all_predictions().get(prediction_id)
        if spec is None:
            continue  # test_each_lesson_has_its_reveal_cells_and_none_stores_a_number names it
        published = {spec.needs} | _published_for(cells, index)
        keys = "|".join(re.escape(k) for k in sorted(published))
        reads = re.compile(rf"""results(?:\[\s*|\.get\(\s*)["']({keys})["']""")
        for later in range(index + 1, len(cells)):
            cell = cells[later]
            found = reads.search(_source(cell)) if cell["cell_type"] == "code" and cell.get("outputs") else None
            if found and not _collapsed(cell):
                problems.append(f"cell {later} reads results[{found.group(1)!r}], published by the run of "
                                f"`%reveal {prediction_id}`, below it, and its output is not stored collapsed")
        recorded = _recorded_answers(prediction_id.split(".")[0])
        if prediction_id not in recorded:
            problems.append(f"no recorded answer for {prediction_id} in {ANSWERS.relative_to(ROOT)}: "
                            f"run `make notebooks NB=notebooks/{path.name}`")
            continue
        pattern = _answer_pattern(recorded[prediction_id])
        # Scanned: everything above the reveal and the rest of its section; a later section printing the same
        # number (06's "256 MiB" of a 7B layer beside a 256-byte answer) is past the point of predicting.
        section_end = next((later for later in range(index + 1, len(cells))
                            if cells[later]["cell_type"] == "markdown"
                            and _source(cells[later]).lstrip().startswith("#")), len(cells))
        for number, cell in enumerate(cells[:section_end]):
            if cell["cell_type"] != "code" or "reveal" in cell.get("metadata", {}).get("tags", []):
                continue
            text = "\n".join(_text_outputs({"outputs": [out]}) for out in cell.get("outputs", []))
            found = _answer_line(_first_line(text) if _collapsed(cell) else text, pattern)
            if found is not None:
                where = "the first line of its collapsed output" if _collapsed(cell) else "its stored output"
                problems.append(f"cell {number} shows the answer to {prediction_id} "
                                f"{recorded[prediction_id]} in {where}: {found.strip()[:120]!r}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_the_answer_check_finds_a_number_as_printed_and_not_inside_another(tmp_path, monkeypatch):
    pattern = _answer_pattern([3, 132096])
    assert _answer_line("bytes [132096, 1]", pattern) and _answer_line("396,288 B vs 132,096 B", pattern)
    for other in ("1320960", "2,132,096", "132096.5"):
        assert _answer_line(other, pattern) is None, other
    assert _answer_pattern([2, True, 7.0]) is None and _answer_line("anything", None) is None
    chunks = _answer_pattern([2.0, 12.0, 22.0, 32.0])
    assert _answer_line("[[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]]", chunks) is None
    assert _answer_line("x\nrank 2: [20, 21, 22, 23] -> [2, 12, 22, 32]", chunks).startswith("rank 2")
    assert _answer_line("[2.0, 12.0, 22.0, 32.0]", chunks)
    assert _first_line("\n\nheader\nrank 0: 132096") == "header"
    monkeypatch.setenv(ANSWERS_ENV, str(tmp_path))
    record_answer("99.bytes", (3, 132096))
    record_answer("99.other", 12)
    assert json.loads((tmp_path / "lesson99.json").read_text()) == {"99.bytes": [3, 132096], "99.other": [12]}


# ---------------------------------------------------------------- the reveal itself, on a made-up prediction


def _fake(monkeypatch, formula_value=12):
    from course_lib import predictions
    from course_lib.predictions.spec import Prediction, Tolerance

    spec = Prediction(id="99.bytes", question="bytes rank 0 sends", needs="sent",
                      measure=lambda results, ledgers: sum(e["bytes"] for e in ledgers[0]),
                      formula=lambda results: formula_value, explanation="two messages of 6 bytes.",
                      unit="B", tolerance=Tolerance(relative=0.01))
    monkeypatch.setattr(predictions, "all_predictions", lambda: {"99.bytes": spec})
    return {"sent": {0: True}}, {0: [{"bytes": 6}, {"bytes": 6}]}


def test_a_reveal_without_a_prediction_says_where_to_write_it_and_shows_no_number(monkeypatch):
    results, ledgers = _fake(monkeypatch)
    text = reveal("99.bytes", None, results, ledgers)
    assert text == write_first("my_prediction") and not NUMBER.search(text)


def test_a_reveal_compares_within_its_tolerance_and_explains(monkeypatch):
    results, ledgers = _fake(monkeypatch)
    right = reveal("99.bytes", 12.1, results, ledgers)
    assert "measured 12 B (within 1%): right." in right and "Why: two messages" in right
    assert "not this time" in reveal("99.bytes", 13, results, ledgers)


def test_a_reveal_refuses_before_its_run_and_when_torch_disagrees_with_the_formula(monkeypatch):
    results, ledgers = _fake(monkeypatch)
    with pytest.raises(RevealError, match="nothing measured yet"):
        reveal("99.bytes", 12, {}, ledgers)
    _fake(monkeypatch, formula_value=13)
    with pytest.raises(RevealError, match="the lesson no longer describes this torch"):
        reveal("99.bytes", None, results, ledgers)


@pytest.fixture
def kernel_state():
    """cl.results, cl.ledgers, each name's run record and the first answers, emptied and put back after."""
    import importlib

    # `course_lib.results` the attribute is cl.results (the dict); the module is reached by its name.
    results_module = importlib.import_module("course_lib.results")
    reveal_module = importlib.import_module("course_lib.predictions.reveal")

    saved = (dict(results_module.results.unchecked()), dict(results_module.ledgers.unchecked()),
             dict(results_module._ledgers_by_name), dict(reveal_module._first_answers))
    for kept in (results_module.results, results_module.ledgers, results_module._ledgers_by_name,
                 reveal_module._first_answers):
        dict.clear(kept)
    yield results_module
    for kept, values in zip((results_module.results, results_module.ledgers, results_module._ledgers_by_name,
                             reveal_module._first_answers), saved):
        dict.clear(kept)
        dict.update(kept, values)
    results_module.mark_stale(None)


def _magics(**user_ns):
    import types

    # The magic's method with a stand-in for the kernel's shell: a real InteractiveShell would stay this
    # process's singleton and change how display() behaves in the tests that run after this one.
    return types.SimpleNamespace(shell=types.SimpleNamespace(user_ns={"my_prediction": None, **user_ns}))


def test_the_reveal_magic_reads_the_learners_variable_and_says_bad_input_in_one_line(monkeypatch, capsys,
                                                                                     kernel_state):
    from course_lib.magics.reveal_magic import RevealMagics, RevealUsageError

    results, ledgers = _fake(monkeypatch)
    kernel_state.record_run(results, ledgers, finished=True)
    magics = _magics()
    RevealMagics.reveal_line(magics, "99.bytes")
    assert capsys.readouterr().out.strip() == write_first("my_prediction")
    magics.shell.user_ns["my_bytes"] = 12
    RevealMagics.reveal_line(magics, "99.bytes my_bytes")
    assert "you predicted 12 B; measured 12 B" in capsys.readouterr().out
    for line, says in (("", "usage: %reveal"), ("99.nope", "no prediction '99.nope'")):
        with pytest.raises(RevealUsageError, match=says) as raised:
            RevealMagics.reveal_line(magics, line)
        assert len(raised.value._render_traceback_()) == 1


def test_a_reveal_measures_its_own_run_whatever_multi_rank_cell_ran_after_it(monkeypatch, capsys, kernel_state):
    """Run All, then back to a prediction: cl.ledgers is the last cell's (no bytes here), the reveal's run is kept."""
    from course_lib.magics.reveal_magic import RevealMagics

    results, ledgers = _fake(monkeypatch)
    kernel_state.record_run(results, ledgers, finished=True)
    kernel_state.record_run({"later": {0: 1}}, {0: [{"bytes": 0}]}, finished=True)  # a later cell: other ledgers
    assert kernel_state.ledgers[0] == [{"bytes": 0}]
    RevealMagics.reveal_line(_magics(my_prediction=12), "99.bytes")
    assert "measured 12 B (within 1%): right." in capsys.readouterr().out


def test_a_reveal_whose_run_was_cut_off_or_never_ran_asks_for_that_cell_in_one_line(monkeypatch, kernel_state):
    from course_lib.magics.reveal_magic import RevealMagics

    results, ledgers = _fake(monkeypatch)
    with pytest.raises(RevealError, match="run the cell above that publishes 'sent'") as raised:
        RevealMagics.reveal_line(_magics(my_prediction=12), "99.bytes")  # a fresh kernel: nothing ran
    assert len(raised.value._render_traceback_()) == 1
    kernel_state.record_run(results, ledgers, finished=True)
    kernel_state.record_run(results, {0: [{"bytes": 6}]}, finished=False)  # the same cell, interrupted
    kernel_state.mark_stale("was interrupted before its ranks finished")
    with pytest.raises(RevealError, match="nothing measured yet"):
        RevealMagics.reveal_line(_magics(my_prediction=12), "99.bytes")


def test_a_reveal_after_a_run_that_failed_with_some_ranks_unpublished_asks_for_that_cell(monkeypatch, kernel_state):
    """A rank lost at init (gloo's connectFullMesh) publishes nothing: the reveal says so in one line, no KeyError."""
    from course_lib.magics.args import RankFailure
    from course_lib.magics.cell_end import CellEnd, finish
    from course_lib.magics.reveal_magic import RevealMagics

    results, ledgers = _fake(monkeypatch)
    partial = {name: {r: v for r, v in by_rank.items() if r != 0} for name, by_rank in results.items()}
    end = CellEnd(stdout={}, stderr={0: "RuntimeError: Gloo connectFullMesh failed\n"}, published=partial,
                  ledgers={r: ledgers[r] for r in ledgers if r != 0}, all_well="", first=0,
                  failure="rank 0 failed: RuntimeError: Gloo connectFullMesh failed")
    with pytest.raises(RankFailure):
        finish(end, expect_failure=False)
    with pytest.raises(RevealError, match="nothing measured yet: run the cell above that publishes 'sent'") as raised:
        RevealMagics.reveal_line(_magics(my_prediction=12), "99.bytes")
    assert len(raised.value._render_traceback_()) == 1
    end.failure, end.published = "rank 0 failed on purpose", results
    finish(end, expect_failure=True)  # a failure the cell expects: its run stays measurable (lessons read it)
    assert kernel_state.ledgers_of("sent") is not None


def test_the_first_answer_is_the_one_scored_and_stays_beside_a_later_one(monkeypatch, kernel_state):
    results, ledgers = _fake(monkeypatch)
    first = reveal("99.bytes", 30, results, ledgers)
    assert "not this time" in first and "first prediction" not in first
    second = reveal("99.bytes", 12, results, ledgers)
    assert "you predicted 12 B; measured 12 B (within 1%): right." in second
    assert "Your first prediction, 30 B, is the one that counts: not this time." in second
    assert "first prediction" not in reveal("99.bytes", 30, results, ledgers)  # the first again: nothing to add
    assert all(len(line) <= 100 for line in second.splitlines())


def test_hints_go_one_level_further_after_each_failed_check_and_stay_at_the_last():
    from course_lib.grading.report import hint_line

    hints = ("Reread section 4.", "dist.all_reduce", "Average every gradient.")
    lines = [hint_line(hints, failed) for failed in range(4)]
    assert lines[0].startswith("hint 1 of 3; the next failed check shows the next: Reread section 4.")
    assert lines[1].endswith(": dist.all_reduce") and lines[1].startswith("hint 2 of 3")
    assert lines[2] == lines[3] == "hint 3 of 3: Average every gradient."
    assert hint_line((), 0) == ""


def test_long_check_lines_wrap_at_100_columns_between_words_indented_under_their_text():
    from course_lib.grading.report import hint_line, item_line
    from course_lib.grading.spec import ItemResult

    name = "gradients of up and down on 2 and 4 ranks, every rank's equal to one process's, in float64 here"
    message = ("backward all-reduced nothing: rank 0's up.weight.grad differs from one process's by 0.25 at "
               "[3, 1]; the ranks' terms must be summed (f), with dist.all_reduce in f's backward")
    lines = item_line(ItemResult(name, 0.0, 1.0, message)).splitlines()
    assert max(map(len, lines)) <= 100 and len(lines) == 4, lines
    assert lines[0].startswith("  FAIL  gradients") and all(line.startswith(" " * 8) for line in lines[1:])
    # Words whole, `all-reduced` and `dist.all_reduce` unbroken, nothing lost.
    assert " ".join(line.strip() for line in lines) == f"FAIL  {name} (0/1) {message}"
    hint = hint_line(("Write an autograd.Function whose forward returns its input and whose backward calls "
                      "dist.all_reduce on the incoming gradient, so the ranks' partial gradients are summed.",), 0)
    first, *rest = hint.splitlines()
    assert first.startswith("hint 1 of 1: ") and rest and all(line.startswith("    ") for line in rest)
    assert max(map(len, hint.splitlines())) <= 100
    assert item_line(ItemResult("short", 1.0, 1.0)) == "  pass  short (1/1)"
    # The score stays with the name's last words, not alone on a line.
    assert item_line(ItemResult("x" * 88 + " end", 1.0, 1.0)).splitlines() == ["  pass  " + "x" * 88, " " * 8 + "end (1/1)"]


@pytest.mark.parametrize("path", REVEALING, ids=lambda p: p.name)
def test_no_text_above_a_reveal_states_its_answer(path):
    """README, "Predict, then measure": the prose a learner reads before predicting holds none of the answer's
    numbers in the order the reveal gives them (lesson 09's "from 15 to 9 tile-times" gave `09.causal_tiles`
    away above its reveal). Searched: the markdown cells above each reveal; one-digit numbers are not
    searched for (they match too much)."""
    cells = _cells(path)
    problems = []
    for index, cell in enumerate(cells):
        found = REVEAL_LINE.search(_source(cell)) if cell["cell_type"] == "code" else None
        if not found:
            continue
        prediction_id = found.group(1)
        recorded = _recorded_answers(prediction_id.split(".")[0])
        pattern = _answer_pattern(recorded.get(prediction_id, []))
        for number, above in enumerate(cells[:index]):
            line = _answer_line(_source(above), pattern) if above["cell_type"] == "markdown" else None
            if line is not None:
                problems.append(f"cell {number}'s text states the answer to {prediction_id} "
                                f"{recorded[prediction_id]} above its reveal: {line.strip()[:160]!r}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)
