"""Lesson 08 (pipeline parallelism), part 3: its exercises graded on real gloo ranks.

The solution scores full marks, the stub zero with its hint (shown once per report), and each plausible wrong
answer loses exactly the points its mistake deserves, with a message that names the rank and what is wrong. One
set of grading ranks serves the whole module (as the grader gives one to a submission). Single-process checks of
the pieces the judges stand on: the deadlock finder, the message reader, the balance cases.
"""

from __future__ import annotations

import re

import nbformat
import pytest

import grading_answers_08 as answers
from exercise_checks import (shared_ranks, assert_full_marks, assert_hang_is_named, assert_loses_exactly,
                             assert_section_states_the_check, assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import assert_lists_exactly, exercise_sections, notebook_path
from course_lib.grading.cells import exercise_cells
from course_lib.grading.lessons.lesson08 import balance
from course_lib.grading.lessons.lesson08.drivers import order_problem, widths
from course_lib.grading.lessons.lesson08.gpipe import messages
from course_lib.grading.registry import exercises_of_lesson

NOTEBOOK = "08_pipeline.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("08")
GPIPE, ORDER, BALANCE = IDS


ranks = shared_ranks(IDS)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["08.gpipe", "08.one_f_one_b", "08.balance"]
    assert_lists_exactly(notebook, NOTEBOOK, IDS)


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    assert_section_states_the_check(exercise_id, exercise_sections("solutions", NOTEBOOK)[exercise_id])


def test_the_solutions_in_the_notebook_are_the_tested_ones():
    for exercise_id, answer in ((GPIPE, answers.GPIPE_SOLUTION), (ORDER, answers.ORDER_SOLUTION),
                                (BALANCE, answers.BALANCE_SOLUTION)):
        cell = "\n".join(line for line in SOLUTIONS[exercise_id].splitlines()
                         if "### " not in line and not line.lstrip().startswith('"""'))
        assert cell.strip() == answer.strip(), exercise_id


# Single process: what the judges stand on.

def _orders(text: dict[int, str]) -> dict[int, list[str]]:
    return {rank: order.split() for rank, order in text.items()}


def test_order_problem_passes_1f1b_and_gpipe_and_names_a_deadlock_and_a_backward_first():
    one_f_one_b = {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}   # the lesson's section 4
    gpipe = {r: "F0 F1 F2 F3 B0 B1 B2 B3" for r in range(2)}
    assert order_problem(_orders(one_f_one_b), 2, 4) == order_problem(_orders(gpipe), 2, 4) == ""
    crossed = {0: "F0 B0 F1 B1", 1: "F0 F1 B0 B1"}   # rank 0 waits for B0, rank 1 for F1 that comes after it
    said = order_problem(_orders(crossed), 2, 2)
    assert said.startswith("these orders deadlock: rank 0 waits at B0 for the gradient of microbatch 0 from "
                           "rank 1, which waits at its F1; rank 1 waits at F1"), said
    assert "runs B1 before F1" in order_problem(_orders({0: "F0 B0 B1 F1", 1: "F0 B0 F1 B1"}), 2, 2)
    assert "runs F1 2 times" in order_problem(_orders({0: "F0 F1 F1 B0 B1", 1: "F0 B0 F1 B1"}), 2, 2)


def test_messages_tell_activations_from_gradients_by_shape_and_by_peer():
    assert widths(2) == [5, 7, 3] and widths(4) == [5, 7, 9, 11, 3]
    # Rank 1 of 4: activations arrive 7 wide, leave 9 wide; gradients the other way.
    ledger = [{"op": "recv", "shapes": [[2, 7]], "bytes": 56}, {"op": "send", "shapes": [[2, 9]], "bytes": 72},
              {"op": "batch_isend_irecv", "shapes": [[2, 9], [2, 7]], "bytes": 128,
               "ops": [["irecv", 2, 72], ["isend", 0, 56]]}]
    assert messages(ledger, 1, 4) == [("recv", "activation", 56), ("send", "activation", 72),
                                      ("recv", "gradient", 72), ("send", "gradient", 56)]


def test_balance_cases_defeat_the_named_wrong_strategies():
    for costs, stages in balance.CASES[1:]:
        best = balance.optimum(costs, stages)
        assert balance.slowest(costs, balance.equal_counts(costs, stages)) > best or costs == (3, 3, 3, 3)
        assert balance.slowest(costs, balance.greedy_to_average(costs, stages)) > best or costs == (3, 3, 3, 3)
    assert balance.optimum((1, 2, 3, 4, 5, 6, 7, 8), 2) == 21


# On real ranks.

@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_says_what_to_write_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


GRADS_2 = "every stage's gradients equal one process's (loss averaged over the microbatches) (2 ranks)"
GRADS_4 = "every stage's gradients equal one process's (loss averaged over the microbatches) (4 ranks)"
LOSS_2 = "the last rank returns the batch's loss, the others None (2 ranks)"
LOSS_4 = "the last rank returns the batch's loss, the others None (4 ranks)"
MESSAGES_2 = "from the ledger: m activations forward and m gradients back per boundary, one microbatch each (2 ranks)"
MESSAGES_4 = "from the ledger: m activations forward and m gradients back per boundary, one microbatch each (4 ranks)"
GPIPE_ORDER_2 = "GPipe's order on every stage: all forwards, then all backwards (2 ranks)"
GPIPE_ORDER_4 = "GPipe's order on every stage: all forwards, then all backwards (4 ranks)"
RUNS_2 = "the orders run to the end on real ranks, equal to one process (2 ranks)"
RUNS_4 = "the orders run to the end on real ranks, equal to one process (4 ranks)"
ALIVE_2 = "at most stages - rank microbatches alive on each rank (2 ranks)"
ALIVE_4 = "at most stages - rank microbatches alive on each rank (4 ranks)"
TORCH_2 = "the order torch's Schedule1F1B runs, on every rank (2 ranks)"
TORCH_4 = "the order torch's Schedule1F1B runs, on every rank (4 ranks)"
VALID = "a valid split on every case: stages counts, each at least 1, adding up to the layers (2 ranks)"
OPTIMAL = "the slowest stage as fast as any cut allows, on cases with known optima (2 ranks)"
GPIPE_ITEMS = (GRADS_2, LOSS_2, MESSAGES_2, GPIPE_ORDER_2, GRADS_4, LOSS_4, MESSAGES_4, GPIPE_ORDER_4)
ORDER_ITEMS = (RUNS_2, ALIVE_2, TORCH_2, RUNS_4, ALIVE_4, TORCH_4)

WRONG = [
    pytest.param(GPIPE, answers.GPIPE_NO_SCALE, {
        GRADS_2: ("rank 0, case 1 of 2 (2 ranks, 2 microbatches)", "it is 2 times one process's",
                  "divided by m = 2"),
        GRADS_4: ("it is 4 times one process's",),
    }, id="gpipe-loss-not-divided-by-m"),
    pytest.param(GPIPE, answers.GPIPE_SUM_RETURNED, {
        LOSS_2: ("rank 1, case 1 of 2", "that is the sum over the 2 microbatches; return their mean"),
        LOSS_4: ("rank 3, case 1 of 2", "that is the sum over the 4 microbatches"),
    }, id="gpipe-returns-the-sum"),
    # Forward and backward of each microbatch in turn: right values, one stage busy at a time.
    pytest.param(GPIPE, answers.GPIPE_F_B_IN_TURN, {
        GPIPE_ORDER_2: ("rank 0, case 1 of 2", "the stage ran F B F B", "a backward before the last forward"),
        GPIPE_ORDER_4: ("the stage ran F B F B F B F B",),
    }, id="gpipe-forward-and-backward-in-turn"),
    pytest.param(GPIPE, answers.GPIPE_WHOLE_BATCH, {
        MESSAGES_2: ("rank 0, case 1 of 2", "sent the activations in 1 message(s) of 168 bytes, the whole batch's",
                     "(2 of 84 bytes)"),
        MESSAGES_4: ("rank 0, case 1 of 2", "(4 of 56 bytes)"),
    }, id="gpipe-whole-batch-at-once"),
    # The received input never requires a gradient: its .grad is None, and sending it raises on the rank.
    pytest.param(GPIPE, answers.GPIPE_NO_REQUIRES_GRAD,
                 {name: ("raised at cell line", "but got <class 'NoneType'>") for name in GPIPE_ITEMS},
                 id="gpipe-input-without-requires-grad"),
    pytest.param(ORDER, answers.ORDER_GPIPE, {
        ALIVE_2: ("rank 1, case 1 of 2 (2 ranks, 2 microbatches): 2 microbatches were alive at once",
                  "your order runs 2 forwards before B0; 1F1B runs 1 (a warm-up of stages - 1 - rank = 0"),
        TORCH_2: ("your order F0 F1 B0 B1; torch's Schedule1F1B ran F0 B0 F1 B1",),
        ALIVE_4: ("rank 1, case 1 of 2 (4 ranks, 4 microbatches): 4 microbatches were alive",),
        TORCH_4: ("your order F0 F1 F2 F3 B0 B1 B2 B3; torch's Schedule1F1B ran F0 F1 F2 B0 F3 B1 B2 B3",),
    }, id="order-gpipe"),
    pytest.param(ORDER, answers.ORDER_SAME_WARM_UP, {
        ALIVE_2: ("rank 1,", "your order runs 2 forwards before B0"),
        TORCH_2: ("rank 1,",),
        ALIVE_4: ("rank 1,", "your order runs 4 forwards before B0; 1F1B runs 3 (a warm-up of stages - 1 - rank = 2"),
        TORCH_4: ("rank 1,",),
    }, id="order-same-warm-up-on-every-rank"),
    # Counted from the wrong end: a deadlock, named at once with the waiting ranks.
    pytest.param(ORDER, answers.ORDER_WARM_UP_BY_RANK, {
        name: ("these orders deadlock: rank 0 waits at B0 for the gradient of microbatch 0 from rank 1, which waits "
               "at its F1",) for name in ORDER_ITEMS
    }, id="order-warm-up-by-rank-deadlocks"),
    pytest.param(ORDER, answers.ORDER_B_FIRST, {
        name: ("one_f_one_b_order(", "runs B0 before F0: a backward needs the activations its forward saved")
        for name in ORDER_ITEMS
    }, id="order-backward-before-its-forward"),
    pytest.param(BALANCE, answers.BALANCE_EQUAL_COUNTS, {
        OPTIMAL: ("balance_stages([1, 2, 3, 4, 5, 6, 7, 8], 2) returned [4, 4]: its slowest stage costs 26",
                  "slowest costs 21: equal layer counts ignore the costs"),
    }, id="balance-equal-counts"),
    pytest.param(BALANCE, answers.BALANCE_GREEDY, {
        OPTIMAL: ("filling each stage up to the average cost",),
    }, id="balance-greedy-to-the-average"),
    pytest.param(BALANCE, answers.BALANCE_BINARY_SEARCH_FEWER_STAGES, {
        VALID: ("rank 1, balance_stages([4, 8, 2, 2, 2], 4) returned [1, 1, 3]: 3 counts for 4 stages; a greedy fill",),
        OPTIMAL: ("not a valid split",),
    }, id="balance-binary-search-fewer-stages"),
    pytest.param(BALANCE, answers.BALANCE_COSTS, {
        VALID: ("returned [15, 21], 36 layers in all; there are 8: these add up to the layers' total cost",),
        OPTIMAL: ("not a valid split",),
    }, id="balance-costs-not-counts"),
    pytest.param(BALANCE, answers.BALANCE_EMPTY_STAGE, {
        VALID: ("returned [8, 0]: every stage needs at least one layer",),
        OPTIMAL: ("not a valid split",),
    }, id="balance-empty-stage"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    got = assert_loses_exactly(exercise_id, source, lost, ranks=ranks)
    for message in got.values():
        assert re.match(r"(rank \d[,: ]|case \d of \d \(\d ranks)", message), message


def test_a_gradient_never_sent_back_is_stopped_and_named(ranks):
    # Rank 0 waits for case 1's first gradient; rank 1, done with case 1, for case 2's first activation.
    assert_hang_is_named(GPIPE, answers.GPIPE_NO_GRAD_SENT,
                         ["ranks 0, 1 are still in your function: they are waiting in recv"], ranks, hang_s=8)
