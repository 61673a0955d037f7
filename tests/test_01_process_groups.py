"""Lesson 01's exercises, graded on real gloo ranks: the solution scores full marks, the stub
zero with its first hint (shown once per report, one more level after each failed check in a kernel), and each
plausible wrong answer loses exactly the points its mistake deserves, with a message that names what is wrong."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import nbformat
import pytest

import grading_answers as answers
from exercise_checks import (assert_deadline_message, assert_full_marks, assert_loses_exactly, assert_section_states_the_check,
                             assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import notebook_path, exercise_sections, markdown_cells
from test_magic_kernel import Kernel
from course_lib.grading.cells import EXERCISE_ID, exercise_cells
from course_lib.grading.checker import Limits, check_exercise
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import hint_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", "01_process_groups.ipynb"), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", "01_process_groups.ipynb"), as_version=4))
IDS = exercises_of_lesson("01")


def _markdown(notebook: str) -> list[str]:
    return markdown_cells(notebook, "01_process_groups.ipynb")


def _sections(notebook: str) -> dict[str, str]:
    return exercise_sections(notebook, "01_process_groups.ipynb")


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["01.ring_allreduce", "01.allgather_from_broadcast", "01.grid_groups"]
    cells = exercise_cells(nbformat.read(notebook_path(notebook, "01_process_groups.ipynb"), as_version=4))
    assert list(cells) == IDS  # the %%exercise cells, in the registry's order
    markdown = "\n".join(_markdown(notebook))
    assert re.findall(r"^\d+\. `(\S+)`", markdown, re.M) == IDS  # the list under Goal
    assert list(_sections(notebook)) == IDS
    named = set(re.findall(rf"\b{EXERCISE_ID.pattern}\b", markdown))
    assert named <= set(IDS), f"the text names exercises nobody grades: {sorted(named - set(IDS))}"


def _shape(value) -> str:
    """How the text writes an input: a tensor's shape or a grid as 3x4, a 1-d tensor's as 10."""
    import torch

    if isinstance(value, torch.Tensor):
        return "x".join(map(str, value.shape))
    return "x".join(map(str, value))


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    """What the checks enforce (lesson01.py, rank_runner's blocked calls), as the learner reads it."""
    import torch

    text, found = _sections("solutions")[exercise_id], exercise(exercise_id)
    assert_section_states_the_check(exercise_id, text)
    for run in found.runs:
        for case in run.make_inputs(run.nproc):
            args = case[0]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            for tensor in tensors:
                assert str(tensor.dtype).removeprefix("torch.") in text, tensor.dtype
            for shown in (map(_shape, tensors) if tensors else [_shape(args)]):
                assert re.search(rf"\b{shown}\b", text), f"{exercise_id}: no case of shape {shown}"


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id])


def test_grid_groups_created_only_by_their_members_score_full_marks():
    # With use_local_synchronization=True a rank creates only its own two groups: right on gloo.
    assert_full_marks("01.grid_groups", answers.GRID_OWN_GROUPS_ONLY)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_with_its_first_hint_once(exercise_id):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id])


WRONG = [
    pytest.param("01.ring_allreduce", answers.RING_AVERAGES, {
        # int64 cannot be divided in place, so the 2-rank run fails as a whole.
        "sums float32 tensors on 2 ranks": "RuntimeError",
        "sums an int64 tensor on 2 ranks (keeps its dtype)": "RuntimeError",
        "sums on 4 ranks, sizes that do not divide by 4": "that is the sum divided by 4; sum, do not average",
    }, id="ring-averages"),
    pytest.param("01.ring_allreduce", answers.RING_FLOAT_BUFFERS, {
        "sums an int64 tensor on 2 ranks (keeps its dtype)":
            "(the messages were float32, the tensor int64: make the buffers with the tensor's dtype)",
    }, id="ring-float-buffers"),
    pytest.param("01.ring_allreduce", answers.RING_WHOLE_TENSOR, {
        "sends 2(N-1)/N of the tensor per rank (a chunked ring)":
            "sent 84 B for a 28 B tensor; a ring over 4 chunks sends at most 48 B",
    }, id="ring-whole-tensor"),
    pytest.param("01.ring_allreduce", answers.RING_USES_ALL_REDUCE, {
        name: "dist.all_reduce is not allowed here" for name in (
            "sums float32 tensors on 2 ranks", "sums an int64 tensor on 2 ranks (keeps its dtype)",
            "sums on 4 ranks, sizes that do not divide by 4", "sends 2(N-1)/N of the tensor per rank (a chunked ring)")
    }, id="ring-all-reduce"),
    pytest.param("01.allgather_from_broadcast", answers.ALLGATHER_ONE_BUFFER, {
        "gathers on 2 ranks (int64 and float32)": "entries 0 and 1 are the same tensor",
        "gathers on 3 ranks": "entries 0 and 1 are the same tensor",
    }, id="allgather-one-buffer"),
    pytest.param("01.allgather_from_broadcast", answers.ALLGATHER_OVERWRITES_INPUT, {
        "gathers on 2 ranks (int64 and float32)": "entry 1 (rank 1's tensor)",
        "gathers on 3 ranks": "entry 1 (rank 1's tensor)",
        "leaves the input tensor unchanged": "the input tensor was changed",
    }, id="allgather-overwrites-input"),
    pytest.param("01.grid_groups", answers.GRID_SWAPPED, {
        "row groups of a 2x2 and a 1x4 grid": "row group has ranks [0, 2], expected [0, 1]: that is its column",
        "column groups of a 2x2 and a 1x4 grid": "column group has ranks [0, 1], expected [0, 2]: that is its row",
        "each group works (all_reduce over it)": "over its row group gave 2, expected 1",
    }, id="grid-swapped"),
    # Each rank creates only its own groups with a plain new_group: the shared names are found before any
    # collective over them, so the same item fails with the same message on every run (it used to hang or
    # mispair from run to run).
    pytest.param("01.grid_groups", answers.GRID_OWN_GROUPS_PLAIN, {
        "each group works (all_reduce over it)":
            "rank 0 of a 2x2 grid: its row group [0, 1] has the same name ('1') as the group [2, 3] that rank 2 created",
    }, id="grid-own-groups-plain"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost):
    assert_loses_exactly(exercise_id, source, lost)


def test_ring_with_the_wrong_neighbour_hangs_on_4_ranks_and_the_deadline_says_where():
    # On 2 ranks both neighbours are the same rank, so the mistake only shows on 4.
    ring = exercise("01.ring_allreduce")
    four_ranks = dataclasses.replace(ring, runs=ring.runs[1:])
    items = check_exercise(four_ranks, answers.RING_WRONG_PEER, limits=Limits(run_timeout_s=6))
    assert [item.score for item in items] == [0, 0]
    message = items[0].message
    assert_deadline_message(message, 6, 4)
    assert "rank 0 is still in your function: it is waiting in recv #" in message, message


@pytest.mark.parametrize("exercise_id, source, phrases", [
    ("01.ring_allreduce", answers.RING_RANK_1_RETURNS, [
        # Numbered among the learner's calls: the checker's barrier before the function is not its #1.
        "rank 0 is still in your function: it is waiting in recv #1 (40 B, world group)",
        "rank 1 finished your function and waits in the checker's barrier (world group)"]),
    ("01.grid_groups", answers.GRID_RANK_0_STUCK, [
        "rank 0 is still in your function: it is waiting in recv #1 (4 B, world group)",
        "ranks 1, 2, 3 finished your function and wait in the checker's all_gather_object (world group)"]),
], ids=["ring-barrier-after", "grid-driver-all-reduce"])
def test_a_hang_in_the_checkers_own_collective_says_it_is_the_checkers(exercise_id, source, phrases):
    found = exercise(exercise_id)
    first_run = dataclasses.replace(found, runs=found.runs[:1])
    items = check_exercise(first_run, source, limits=Limits(run_timeout_s=4))
    message = items[0].message
    assert_deadline_message(message, 4, found.runs[0].nproc)
    for phrase in phrases:
        assert phrase in message, message


def test_in_a_kernel_check_before_saving_is_one_line_and_each_failed_check_shows_the_next_hint(tmp_path):
    """The learner's path in JupyterLab: cl.check before the %%exercise cell ran, then twice on the stub:
    "not written yet" once each time, no hint; then twice on a wrong answer: the first failed check prints
    hint level 1 (the section), the second level 2 (the API), each once."""
    hints = exercise("01.allgather_from_broadcast").hints
    kernel = Kernel(tmp_path / "kernel.log")
    try:
        assert kernel.execute("%load_ext course_lib\nimport course_lib as cl", timeout_s=30).status == "ok"
        early = kernel.execute('cl.check("01.allgather_from_broadcast")', timeout_s=30)
        (error,) = early.of_type("error")
        assert (error["ename"], error["traceback"]) == ("CheckError", [f"CheckError: {error['evalue']}"])
        assert "run the cell that starts with %%exercise 01.allgather_from_broadcast first" in error["evalue"]
        assert early.seen == {}, early.names  # no rank, no rank server: nothing ran
        assert kernel.execute(STUBS["01.allgather_from_broadcast"], timeout_s=30).status == "ok"
        items = sum(len(run.items) for run in exercise("01.allgather_from_broadcast").runs)
        for _ in range(2):  # the untouched stub: one line, and no hint level used up
            report = kernel.execute('cl.check("01.allgather_from_broadcast")', timeout_s=120)
            printed = report.text("stdout").splitlines()
            assert report.status == "ok" and len(printed) == 3, printed  # the runs' line, then the verdict
            assert " ".join(printed[1:]).startswith(
                "01.allgather_from_broadcast: not written yet (its stub raised NotImplementedError at cell line "), printed
            assert " ".join(printed).count("not written yet") == 1 and "FAIL" not in report.text("stdout")
            assert "hint" not in report.text("stdout")
        assert kernel.execute(answers.ALLGATHER_ONE_BUFFER, timeout_s=30).status == "ok"
        for level in (1, 2):
            report = kernel.execute('cl.check("01.allgather_from_broadcast")', timeout_s=120)
            printed = report.text("stdout")
            assert report.status == "ok" and 0 < printed.count("  FAIL  ") < items, printed
            assert printed.count(hint_line(hints, level - 1)) == 1, printed
            assert printed.count(f"hint {level} of 3") == 1, printed
            flat = " ".join(printed.split())  # lines are wrapped at 100 columns (grading/report.py)
            shown = [hint for hint in hints if " ".join(hint.split()) in flat]
            assert shown == [hints[level - 1]], printed  # one level at a time, never the others
    finally:
        kernel.shutdown()


def test_gloo_abort_message_compares_equal_across_torch_versions():
    """Lesson 01's mismatch cell stores gloo's abort message, whose source line moves between torch builds
    (pair.cc:456 on 2.13, :464 on 2.15): nbval's sanitizer (tests/nbval_sanitize.cfg) makes both one text."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "tests" / "nbval_sanitize.cfg")
    section = config["gloo-source-lines"]
    message = ("[rank 0]   what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
               "pair.cc:{}] op.preamble.length <= op.nbytes. 8 vs 4.")
    seen = {re.sub(section["regex"], section["replace"], message.format(line)) for line in (456, 464)}
    assert seen == {message.format("N")}
