"""Lesson 03's exercises, graded on real gloo ranks: the solution scores full marks, the stub
zero with its hint (shown once per report), and each plausible wrong answer loses exactly the points
its mistake deserves, with a message that names what is wrong; an answer that hangs is stopped at
its deadline with the rank and the collective it waits in.

One set of grading ranks serves the whole module (as the grader gives one to a submission): it is
started once, forked from a server that has imported torch._dynamo (DDP's constructor imports it)
and ZeroRedundancyOptimizer's module, and restarted only after a run that failed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import nbformat
import pytest

import grading_answers_03 as answers
from exercise_checks import (
    assert_full_marks, assert_hang_is_named, assert_stub_scores_zero_with_its_first_hint_once, failed_items)
from exercise_notebooks import notebook_path, exercise_sections, markdown_cells
from course_lib.grading.cells import EXERCISE_ID, exercise_cells
from course_lib.grading.checker import check_exercise, preload_for, rank_set_for
from course_lib.grading.lessons.lesson02.exercises import ATOL, RTOL, _batch, _sgd_step, _weights
from course_lib.grading.lessons.lesson03.exercises import (
    ADAM_LR, LR, STATE_ATOL, STATE_RTOL, ZERO1_DEFAULTS, first_out, greedy_owners, join_reference)
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = "03_join.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("03")
JOIN, COUNTER, ZERO, ZERO1 = IDS
HANG_S = 4  # the deadline of a run that hangs: long enough for the steps before the hang


@pytest.fixture(scope="module")
def ranks():
    with rank_set_for([exercise(i) for i in IDS]) as shared:
        yield shared


def _markdown(notebook: str) -> list[str]:
    return markdown_cells(notebook, NOTEBOOK)


def _sections(notebook: str) -> dict[str, str]:
    return exercise_sections(notebook, NOTEBOOK)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["03.join_uneven_training", "03.counting_joinable", "03.zero_consolidate_save", "03.zero1_by_hand"]
    cells = exercise_cells(nbformat.read(notebook_path(notebook, NOTEBOOK), as_version=4))
    assert list(cells) == IDS  # the %%exercise cells, in the registry's order
    markdown = "\n".join(_markdown(notebook))
    assert re.findall(r"^\d+\. `(\S+)`", markdown, re.M) == IDS  # the list under Goal
    assert list(_sections(notebook)) == IDS
    named = set(re.findall(rf"\b{EXERCISE_ID.pattern}\b", markdown))
    assert named <= set(IDS), f"the text names exercises nobody grades: {sorted(named - set(IDS))}"


def _and(numbers: list[int]) -> str:
    """[2, 4, 3] -> "2, 4 and 3"."""
    return ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"


def _case_phrases(exercise_id: str, case: dict) -> list[str]:
    """What the text must say about one case (the world size is checked apart)."""
    n = len(case)
    if exercise_id == JOIN:
        counts = [len(case[r][1]) for r in range(n)]
        return [f"{_and(counts)} batches (" + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)) + ")",
                f"Batches have {case[0][1][0][0].shape[0]} rows", f"`stop_at_first={case[0][3]}`"
                if n == 3 else "once with `stop_at_first=False` and once with `True`"]
    if exercise_id == COUNTER:
        values = [case[r][0] for r in range(n)]
        listed = "; ".join(f"rank {r}: " + ", ".join(f"{v:g}" for v in vs) for r, vs in enumerate(values))
        return [f"{_and([len(vs) for vs in values])} calls (", listed]
    steps, rows = len(case[0][1]), case[0][1][0][0].shape[0]
    if exercise_id == ZERO1:
        name, defaults = case[0][2], case[0][3]
        options = ", ".join(f"{k}={v:g}" for k, v in defaults.items())
        return [f"`torch.optim.{name}({options})`", f"{steps} steps of {rows} rows per rank"]
    saved_after = case[0][2]
    return [f"{saved_after} steps of {rows} rows per rank (batches of {n * rows} rows), saved, then "
            f"{steps - saved_after} more steps"]


def _power(tolerance: float) -> str:
    """A tolerance as the text writes it: 1e-05 -> "1e-5"."""
    return f"{tolerance:.0e}".replace("e-0", "e-")


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    """What the checks enforce (lesson03.py, rank_runner's blocked calls), as the learner reads it."""
    text, found = _sections("solutions")[exercise_id], exercise(exercise_id)
    assert f"**Graded on** {len(found.runs)} runs" in text
    for run in found.runs:
        assert f"deadline of {run.timeout_s:g} s" in text
        assert f"{run.nproc} ranks" in text
        for case in run.make_inputs(run.nproc):
            for phrase in _case_phrases(exercise_id, case):
                assert phrase in text, f"{exercise_id}: no {phrase!r}"
    if exercise_id == JOIN:
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text and f"lr {LR:g}" in text
    if exercise_id == ZERO:
        assert f"rtol {_power(STATE_RTOL)} and atol {_power(STATE_ATOL)}" in text and f"lr={ADAM_LR:g}" in text
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text
    if exercise_id == ZERO1:
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text
        assert ZERO1_DEFAULTS == {"Adam": {"lr": ADAM_LR}, "SGD": {"lr": 0.1, "momentum": 0.9}}
    for op in sorted(found.allowed_ops):
        assert f"`dist.{op}`" in text
    assert "Any other collective or point-to-point call" in text
    assert "`dist.get_rank()`" in text  # not a communication: never blocked


def test_the_join_reference_with_even_inputs_is_one_process_on_the_whole_batch():
    """Two ranks with one batch each: DDP's step, the sum over 2 divided by 2, is the whole batch's SGD step."""
    weights, (inputs, targets) = _weights(5), _batch(6, 55)
    shards = [[(inputs[:3], targets[:3])], [(inputs[3:], targets[3:])]]
    got, expected = join_reference(weights, shards, LR), _sgd_step(weights, inputs, targets, LR)
    for name, value in expected.items():
        assert got[name].allclose(value, rtol=RTOL, atol=ATOL), name
    # A rank that has joined adds zeros: a second step taken by rank 1 alone is half its own gradient.
    alone = join_reference(weights, [shards[0], shards[1] * 2], LR)
    by_active = join_reference(weights, [shards[0], shards[1] * 2], LR, divide_by_initial=False)
    assert not all(alone[n].allclose(by_active[n]) for n in alone)


def test_the_greedy_partition_and_the_first_rank_out_follow_their_rules():
    """ZeroRedundancyOptimizer's rule (largest first, to the least-loaded rank, the lowest on a tie); the
    lesson's model (128, 16, 64, 4 elements) and the exercises' (24, 6, 12, 2)."""
    assert greedy_owners([128, 16, 64, 4], 2) == [0, 1, 1, 1]
    assert greedy_owners([24, 6, 12, 2], 3) == [0, 2, 1, 2]
    assert greedy_owners([5, 5, 5, 5], 3) == [0, 1, 2, 0]  # ties: the earlier tensor, the lower rank
    assert [first_out(c) for c in ([3, 2], [3, 4, 2], [4, 2, 2])] == [1, 2, 1]


def test_the_exercises_fork_their_ranks_with_what_ddp_and_zero_import(ranks):
    """DDP's constructor imports torch._dynamo (seconds), ZeRO its module: the server imports both first."""
    assert preload_for([exercise(COUNTER)]) == ()
    assert preload_for([exercise(i) for i in IDS]) == (
        "torch._dynamo", "torch.distributed.optim.zero_redundancy_optimizer")
    found = exercise(ZERO)
    # The cell runs on the ranks before the checker's DDP and ZeRO exist: their modules are there already.
    cell = answers.ZERO_SOLUTION.replace(
        "import torch\n", "import sys\nimport torch\n\nassert 'torch._dynamo' in sys.modules, 'not preloaded'\n"
        "assert 'torch.distributed.optim.zero_redundancy_optimizer' in sys.modules, 'not preloaded'\n", 1)
    items = check_exercise(dataclasses.replace(found, runs=found.runs[:1]), cell, ranks=ranks)
    assert all(item.passed for item in items), "\n".join(map(item_line, items))


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_gradescope_shows_its_first_hint_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


SHADOW_2, STOP_2, FIRST_2, SHADOW_3, STOP_3, FIRST_3 = (
    "shadowing: every rank ends with one process's parameters (2 ranks: 3 and 2 batches)",
    "stopping at the first rank out: every rank ends with the parameters of the steps all ranks took (2 ranks)",
    "every rank returns the rank that ran out first (2 ranks)",
    "shadowing: every rank ends with one process's parameters (3 ranks: 3, 4 and 2 batches)",
    "stopping at the first rank out: every rank ends with the parameters of the steps all ranks took (3 ranks: "
    "4, 2 and 2 batches)",
    "every rank returns the rank that ran out first, a tie included (3 ranks)")
COUNT_2, LAST_2, COUNT_3, LAST_3 = (
    "every rank: count 5, total -8, peak -0.5 (2 ranks: 2 and 3 calls)",
    "post_hook: is_last_joiner True on the rank with the most calls only (2 ranks)",
    "every rank: the count, total and peak of all values (3 ranks: 1, 3, 2 and 3, 1, 3 calls)",
    "post_hook: is_last_joiner True on the ranks with the most calls, a tie included (3 ranks)")
LOADS_2, STATE_2, RESUMED_2, STATE_3, RESUMED_3 = (
    "rank 0's file loads into a plain torch.optim.Adam (2 ranks)",
    "its state equals one process's Adam after 3 steps on the whole batch (2 ranks)",
    "loaded on every rank, 2 more steps give one process's Adam after 5 steps (2 ranks)",
    "its state equals one process's Adam after 2 steps on the whole batch (3 ranks)",
    "loaded on every rank, 2 more steps give one process's Adam after 4 steps (3 ranks)")
ADAM_2, SGD_2, SHARE_2, ADAM_3, SHARE_3 = (
    "parameters equal one process's Adam after 3 steps, on every rank (2 ranks)",
    "parameters equal one process's SGD with momentum after 3 steps (2 ranks)",
    "each rank's optimizer state is its greedy share, in bytes (2 ranks)",
    "parameters equal one process's Adam after 3 steps, on every rank (3 ranks)",
    "each rank's optimizer state is its greedy share, in bytes (3 ranks)")
NOT_CONSOLIDATED = "RuntimeError: Optimizer state has not been consolidated on this rank"
SHARD_FILE = "the file holds the state of 1 of the model's 4 parameters: one rank's shard"
NOT_SENT = "and this rank never received the result: after the step every parameter must go from its owner"
OWN_ROWS = "that is each owner's step with the gradient of its own rows only; average the gradients"

WRONG = [
    pytest.param(JOIN, answers.JOIN_DIVIDES_BY_ACTIVE, {
        SHADOW_2: "rank 0, case 1 of 2 (stop_at_first=False, batches of 3 rows per rank: rank 0: 3, rank 1: 2): "
                  "0.weight element [0, 0] is -0.250352, expected -0.250225: that is the training with "
                  "divide_by_initial_world_size=False (each step divided by the ranks still training); keep the "
                  "default, True: a joined rank contributes zeros and the sum is divided by the initial world "
                  "size, 2",
        SHADOW_3: "that is the training with divide_by_initial_world_size=False",
    }, id="join-divides-by-active-ranks"),
    pytest.param(JOIN, answers.JOIN_NEVER_STOPS, {
        STOP_2: "rank 0, case 2 of 2 (stop_at_first=True, batches of 3 rows per rank: rank 0: 3, rank 1: 2): "
                "0.weight element [0, 0] is 0.0122718, expected 0.0223189: that is the training of every batch "
                "(the ranks that ran out shadowed the others); with stop_at_first=True every rank stops after the "
                "2 steps that all ranks took",
        STOP_3: "that is the training of every batch",
    }, id="join-never-stops"),
    pytest.param(JOIN, answers.JOIN_ONLY_THE_RANK_OUT_KNOWS, {
        FIRST_2: "rank 0, case 1 of 2 (stop_at_first=False, batches of 3 rows per rank: rank 0: 3, rank 1: 2): "
                 "returned None, expected 1: every rank returns the rank that ran out first, an int, the same on "
                 "every rank",
        FIRST_3: "returned None, expected 2",
    }, id="join-only-the-rank-out-knows"),
    pytest.param(JOIN, answers.JOIN_HIGHEST_ON_TIE, {
        FIRST_3: "rank 0, case 2 of 2 (stop_at_first=True, batches of 3 rows per rank: rank 0: 4, rank 1: 2, "
                 "rank 2: 2): returned 2, expected 1: ranks 1, 2 ran out together; return the lowest",
    }, id="join-highest-on-a-tie"),
    pytest.param(COUNTER, answers.COUNTER_SHADOWS_WITH_ONES, {
        COUNT_2: "rank 0, case 1 of 1 (calls per rank: rank 0: 2, rank 1: 3): count is 6, expected 5 (over every "
                 "rank's values): that is 2 ranks times 3 iterations, every rank counted in every iteration; a rank "
                 "that has joined takes no part in the others' iterations",
        COUNT_3: "count is 9, expected 6",
    }, id="counter-shadows-with-ones"),
    pytest.param(COUNTER, answers.COUNTER_PEAK_SHADOWED_WITH_ZERO, {
        COUNT_2: "rank 0, case 1 of 1 (calls per rank: rank 0: 2, rank 1: 3): peak is 0, expected -0.5 (over every "
                 "rank's values): every value is negative, so 0 came from a rank that had joined; what a joined "
                 "rank contributes must change no result: 0 leaves a sum alone, not a maximum",
        COUNT_3: "peak is 0, expected -0.5",
    }, id="counter-peak-shadowed-with-zero"),
    pytest.param(COUNTER, answers.COUNTER_POST_HOOK_FORGETS, {
        LAST_2: "rank 0, case 1 of 1 (calls per rank: rank 0: 2, rank 1: 3): counter.is_last_joiner is None "
                "afterwards; what post_hook is told must be stored on the counter",
        LAST_3: "counter.is_last_joiner is None afterwards",
    }, id="counter-post-hook-forgets"),
    pytest.param(ZERO, answers.ZERO_NO_CONSOLIDATE, {
        name: f"rank 0 raised at cell line 8: {NOT_CONSOLIDATED}. Please call `consolidate_state_dict(to=0)` on "
              "all ranks" for name in (LOADS_2, STATE_2, RESUMED_2, STATE_3, RESUMED_3)
    }, id="zero-not-consolidated"),
    pytest.param(ZERO, answers.ZERO_SAVES_ON_EVERY_RANK, {
        name: f"rank 1 raised at cell line 8: {NOT_CONSOLIDATED}"
        for name in (LOADS_2, STATE_2, RESUMED_2, STATE_3, RESUMED_3)
    }, id="zero-saves-on-every-rank"),
    pytest.param(ZERO, answers.ZERO_SAVES_LOCAL_SHARD, {
        LOADS_2: f"rank 0, case 1 of 1 (3 Adam steps, saved, 2 more after loading; 4 rows per rank per step): "
                 f"{SHARD_FILE}; the file must hold the state of every parameter, gathered from every rank",
        STATE_2: SHARD_FILE,
        RESUMED_2: "load_optimizer raised ValueError: loaded state dict contains a parameter group that doesn't "
                   "match the size of optimizer's group",
        STATE_3: f"rank 0, case 1 of 1 (2 Adam steps, saved, 2 more after loading; 2 rows per rank per step): "
                 f"{SHARD_FILE}",
        RESUMED_3: "load_optimizer raised ValueError",
    }, id="zero-saves-rank-0s-shard"),
    pytest.param(ZERO, answers.ZERO_LOADS_ON_RANK_0, {
        RESUMED_2: "rank 0, case 1 of 1 (3 Adam steps, saved, 2 more after loading; 4 rows per rank per step): "
                   "after resuming, 0.weight element [0, 0] is 0.098589, expected 0.0984278: that is the state "
                   "loaded on rank 0 only: the parameters ranks 1 to 1 own resumed their Adam state from zero",
        RESUMED_3: "the parameters ranks 1 to 2 own resumed their Adam state from zero; each rank keeps the state "
                   "of its own share, so every rank loads the file",
    }, id="zero-loads-on-rank-0-only"),
    pytest.param(ZERO, answers.ZERO_LOADS_INTO_INNER, {
        RESUMED_2: "rank 0, case 1 of 1 (3 Adam steps, saved, 2 more after loading; 4 rows per rank per step): "
                   "load_optimizer raised ValueError: loaded state dict contains a parameter group that doesn't "
                   "match the size of optimizer's group: the optimizer it loads into holds fewer parameters than "
                   "the file",
        RESUMED_3: "load_optimizer raised ValueError",
    }, id="zero-loads-into-the-inner-optimizer"),
    pytest.param(ZERO1, answers.ZERO1_STEPS_EVERYTHING, {
        SHARE_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): optim.state "
                 "holds 368 B, the state of every parameter: every rank steps everything, nothing is sharded; the "
                 "greedy split (largest first, each to the rank holding the fewest elements so far, the lowest rank "
                 "on a tie) gives rank 0 0.weight: 196 B",
        SHARE_3: "optim.state holds 368 B, the state of every parameter: every rank steps everything",
    }, id="zero1-every-rank-steps-everything"),
    pytest.param(ZERO1, answers.ZERO1_NO_BROADCAST, {
        ADAM_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): 0.bias still "
                f"holds its initial value; rank 1 stepped it {NOT_SENT} to every other rank",
        SGD_2: NOT_SENT,
        ADAM_3: f"0.bias still holds its initial value; rank 2 stepped it {NOT_SENT}",
    }, id="zero1-no-broadcast"),
    pytest.param(ZERO1, answers.ZERO1_NOT_AVERAGED, {
        ADAM_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): 0.weight "
                f"element [0, 0] is -0.266174, expected -0.265075: {OWN_ROWS} over the ranks before stepping",
        SGD_2: OWN_ROWS,
        ADAM_3: OWN_ROWS,
    }, id="zero1-gradients-not-averaged"),
    # Adam's step hardly changes when every gradient is N times larger: only SGD shows the sum.
    pytest.param(ZERO1, answers.ZERO1_SUMMED, {
        SGD_2: "rank 0, case 2 of 2 (torch.optim.SGD(lr=0.1, momentum=0.9), 3 steps, 4 rows per rank per step): "
               "0.weight element [0, 0] is 0.0488728, expected 0.0218406: that is a step with the sum of the 2 "
               "ranks' gradients; average them (divide by the world size)",
    }, id="zero1-gradients-summed"),
    pytest.param(ZERO1, answers.ZERO1_ROUND_ROBIN, {
        SHARE_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): optim.state "
                 "holds 296 B (the state of 0.weight, 2.weight); the greedy split",
        SHARE_3: "optim.state holds 216 B (the state of 0.weight, 2.bias); the greedy split",
    }, id="zero1-round-robin-partition"),
    pytest.param(ZERO1, answers.ZERO1_WRAPS_TORCHS, {
        name: "RuntimeError: ZeroRedundancyOptimizer is what this exercise asks you to build: it is not allowed here"
        for name in (ADAM_2, SGD_2, SHARE_2, ADAM_3, SHARE_3)
    }, id="zero1-wraps-torchs-zero"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    items = check_exercise(exercise(exercise_id), source, ranks=ranks)
    got = failed_items(items)
    assert sorted(got) == sorted(lost), "\n".join(map(item_line, items))
    for name, phrase in lost.items():
        assert phrase in got[name], f"{name}: {got[name]!r} lacks {phrase!r}"


HANGS = [
    # DDP's bucket all-reduce goes through the checker's Python hook, so the ledger names it.
    # Rank 1 (2 batches) returns and goes on to the checker's next case, whose DDP constructor waits too.
    pytest.param(JOIN, answers.JOIN_MISSING, [
        "rank 0 is still in your function: it is waiting in all_reduce #3 (176 B, world group)",
        "rank 1 finished your function"], id="join-missing"),
    # Without the notice, the pairs shift: rank 0's Join counts the ranks left (4 B) while rank 1 sums (8 B).
    pytest.param(COUNTER, answers.COUNTER_NO_NOTIFY, [
        "rank 0 is still in your function: it is waiting in all_reduce #5 (4 B, world group)",
        "rank 1 is still in your function: it is waiting in all_reduce #5 (8 B, world group)"], id="counter-no-notify"),
    # consolidate_state_dict is a collective: rank 0 waits for rank 1's shard, which never comes.
    pytest.param(ZERO, answers.ZERO_CONSOLIDATE_ON_RANK_0, [
        "rank 0 is still in your function: it is waiting in broadcast #1 (8 B, world group)",
        "rank 1 finished your function and waits in the checker's all_reduce (world group)"],
        id="zero-consolidates-on-rank-0-only"),
]


@pytest.mark.parametrize("exercise_id, source, phrases", HANGS)
def test_an_answer_that_hangs_is_stopped_at_its_deadline_naming_the_rank_and_collective(
        exercise_id, source, phrases, ranks):
    assert_hang_is_named(exercise_id, source, phrases, ranks, HANG_S)
