"""Each lesson's reveals, run again after Run All, the way a learner comes back to a prediction.

nbval runs a notebook's cells once, in order, in one kernel: that is Run All. This adds one item after
a lesson notebook's last cell, in the same kernel (so every later multi-rank cell has run by then):
for each `%reveal <id> [variable]` cell it sets the variable to the answer `make notebooks` recorded
(tests/reveal_answers/lessonNN.json) and runs the reveal again: it must say "right"; then to a wrong
value: "not this time", with the measured answer and the first answer beside it. A reveal that read
the last cell's ledger instead of its own run's fails here (lesson 06's `06.tp_mlp_bytes` did).

tests/conftest.py adds the item (`add_reveal_items`) when the notebooks are collected with tests/,
as `make test` does. For one notebook, name this file too so that tests/conftest.py is loaded:
    pytest tests/reveals_after_run_all.py notebooks/06_tensor_parallel.ipynb
"""

from __future__ import annotations

import json
import pathlib
import queue
import re

import pytest

ANSWERS = pathlib.Path(__file__).resolve().parent / "reveal_answers"  # lessonNN.json, from `make notebooks`
REVEAL = re.compile(r"^\s*%reveal\s+(\S+)(?:\s+(\w+))?\s*$", re.M)
REVEAL_TIMEOUT_S = 120  # a reveal reads recorded results only: seconds, even on a loaded machine


def reveals_in(notebook: pathlib.Path) -> list[tuple[str, str]]:
    """(prediction id, variable) of every `%reveal` cell of the notebook, in order."""
    cells = json.loads(notebook.read_text())["cells"]
    return [(m.group(1), m.group(2) or "my_prediction") for c in cells if c["cell_type"] == "code"
            for m in REVEAL.finditer("".join(c["source"]))]


def as_guess(values: list) -> object:
    """The recorded answer as a learner writes it: a number, or a tuple of numbers."""
    return values[0] if len(values) == 1 else tuple(values)


def wrong(values: list) -> object:
    """A wrong answer outside any tolerance the predictions use: each number times ten, plus one."""
    return as_guess([v * 10 + 1 for v in values])


def run_in_kernel(kernel, code: str) -> str:
    """Run `code` in nbval's kernel; what it printed (lines wrapped by the reveal joined again), errors as
    `Name: value`."""
    msg_id = kernel.execute_cell_input(code, allow_stdin=False)
    printed = []
    while True:
        try:
            msg = kernel.get_message(stream="iopub", timeout=REVEAL_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"no answer from the kernel within {REVEAL_TIMEOUT_S} s to: {code!r}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return " ".join(line.strip() for line in "".join(printed).splitlines())
        if kind == "stream":
            printed.append(content["text"])
        elif kind == "error":
            printed.append(f"{content['ename']}: {content['evalue']}\n")


class RevealsAfterRunAll(pytest.Item):
    """Every reveal of one lesson notebook, re-run with the right and then a wrong prediction."""

    def __init__(self, *, reveals: list[tuple[str, str]], answers: dict, **kwargs):
        super().__init__(**kwargs)
        self.reveals, self.answers = reveals, answers

    def runtest(self) -> None:
        kernel = self.parent.kernel
        if self.parent.timed_out or kernel is None or not kernel.is_alive():
            pytest.skip("a cell of the notebook timed out or its kernel died: nbval reports it")
        problems = []
        for prediction_id, variable in self.reveals:
            if prediction_id not in self.answers:
                problems.append(f"{prediction_id}: no recorded answer (run `make notebooks` for this notebook)")
                continue
            recorded = self.answers[prediction_id]
            said = run_in_kernel(kernel, f"{variable} = {as_guess(recorded)!r}\n%reveal {prediction_id} {variable}")
            if ": right." not in said:
                problems.append(f"{prediction_id} with the recorded answer {as_guess(recorded)!r}: {said.strip()!r}")
                continue
            said = run_in_kernel(kernel, f"{variable} = {wrong(recorded)!r}\n%reveal {prediction_id} {variable}")
            if ": not this time." not in said or "is the one that counts: right." not in said:
                problems.append(f"{prediction_id} with the wrong answer {wrong(recorded)!r} after the right one: "
                                f"{said.strip()!r}")
            run_in_kernel(kernel, f"{variable} = None")  # as the stored notebook has it
        assert not problems, "\n".join(problems)

    def reportinfo(self):
        return self.path, None, f"{self.parent.name}: every reveal again after Run All"


def add_reveal_items(items: list) -> None:
    """After the last cell of each lesson notebook with reveals, its RevealsAfterRunAll item (in place)."""
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:  # nbval not installed: no notebook items either
        return
    last_cell = {}
    for index, item in enumerate(items):
        if isinstance(item.parent, IPyNbFile):
            last_cell[item.parent] = index
    for notebook, index in sorted(last_cell.items(), key=lambda kv: kv[1], reverse=True):
        path = pathlib.Path(str(notebook.fspath))
        reveals = reveals_in(path)
        lesson = path.name[:2]
        if not reveals or path.parent.name != "notebooks" or not lesson.isdigit():
            continue
        answers_file = ANSWERS / f"lesson{lesson}.json"
        answers = json.loads(answers_file.read_text()) if answers_file.exists() else {}
        items.insert(index + 1, RevealsAfterRunAll.from_parent(notebook, name="reveals after Run All",
                                                               reveals=reveals, answers=answers))
