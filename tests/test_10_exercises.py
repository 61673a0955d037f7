"""Lesson 10 (mixture of experts, expert parallelism): its exercises graded on real gloo ranks.

The solutions score full marks, the stubs zero with their hint (shown once per report), and the wrong answers
most worth a run on ranks lose exactly the points their mistake deserves, with a message naming the rank and the
mistake; one set of grading ranks serves the module. A rank that skips the count exchange is stopped at a short
deadline, named waiting in all_to_all_single; split sizes that disagree between ranks end the run at once, named
with the case. A right answer using torch's autograd collectives (torch.distributed.nn.functional) scores full marks
on both runs of one set. 10.priority_capacity needs no communication, so its other answers run in this process
through the exercise's own driver and judges; the other plausible slips are checked in one process against the
judges themselves (which pairs a rule keeps, which value or gradient factor a slip gives, the bytes the ledger
reads), since the judges see only tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re

import nbformat
import pytest
import torch

import grading_answers_10 as answers
from exercise_checks import (assert_deadline_message, assert_full_marks, assert_loses_exactly,
                             assert_section_states_the_check, assert_stub_scores_zero_with_its_first_hint_once,
                             shared_ranks)
from exercise_notebooks import assert_lists_exactly, exercise_sections, notebook_path
from course_lib.grading.cells import exercise_cells
from course_lib.grading.checker import check_exercise, submission_source
from course_lib.grading.lessons.lesson10 import dedup_dispatch, drivers, global_balance, priority_capacity
from course_lib.grading.lessons.lesson10.common import EXPERTS, K, layer_out, make_layer, make_tokens, route
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.spec import CaseResult, Limits, RunOutcome

NOTEBOOK = "10_moe_expert_parallel.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("10")
PRIORITY, DEDUP, GLOBAL = IDS

ranks = shared_ranks(IDS)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["10.priority_capacity", "10.dedup_dispatch", "10.global_balance_loss"]
    assert_lists_exactly(notebook, NOTEBOOK, IDS)


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    assert_section_states_the_check(exercise_id, exercise_sections("solutions", NOTEBOOK)[exercise_id])


def test_the_priority_section_states_its_factors():
    text = " ".join(exercise_sections("solutions", NOTEBOOK)[PRIORITY].split())
    for _, factor, *_ in priority_capacity.CASES:
        assert f"{factor}" in text
    assert "ceil(factor · T · k / E)" in text


def test_the_solutions_in_the_notebook_are_the_tested_ones():
    def code(text):   # without the regions' markers and one-line docstrings (the cell adds one per function)
        return "\n".join(line for line in text.strip().splitlines()
                         if "### " not in line and not re.match(r'\s*""".*"""$', line))
    for exercise_id, answer in ((PRIORITY, answers.PRIORITY_SOLUTION), (DEDUP, answers.DEDUP_SOLUTION),
                                (GLOBAL, answers.GLOBAL_SOLUTION)):
        assert code(SOLUTIONS[exercise_id]) == code(answer), exercise_id


# Single process: what the judges stand on.

def test_the_layer_is_the_lessons_router_and_experts():
    x = make_tokens(5, seed=3)
    probs, weights, experts = route(x, make_layer()["router"], K)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    assert torch.equal(experts, probs.topk(K, -1).indices)
    dense = torch.stack([sum(w * layer_out(x[t:t + 1], make_layer(), torch.ones(1, 1), e.view(1, 1))[0]
                             for w, e in zip(weights[t], experts[t])) for t in range(5)])
    torch.testing.assert_close(layer_out(x, make_layer(), weights, experts), dense)


def test_batch_priority_walks_first_choices_before_second_by_largest_probability():
    # Three tokens, two experts, capacity 1: token 2 is surest, so it takes expert 0 with its first choice.
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.9, 0.05, 0.05]])
    experts = torch.tensor([[0, 1], [1, 2], [0, 1]])
    assert priority_capacity.kept_pairs(probs, experts, 1).tolist() == [[False, False], [True, True], [True, False]]
    assert priority_capacity.kept_pairs(probs, experts, 1, "position").tolist() == [[True, False], [True, True],
                                                                                    [False, False]]
    assert priority_capacity.capacity_of(1.1, 16, 2) == 5 and priority_capacity.capacity_of(0.9, 16, 2) == 4


def test_each_named_priority_slip_differs_from_the_rule_on_the_items_it_loses():
    # Each rule the kept judge names keeps other pairs than batch priority somewhere in the items it must lose:
    # position order, lowest first and per-expert weights on both items; the floor and the missing k as stated.
    integer, other = (0, 1), (2, 3)
    def differs(cases, order="priority", rounding=math.ceil, k=K):
        found = False
        for case in cases:
            for rank in range(2):
                x, probs, weights, experts, C = priority_capacity.case_tensors(case, rank)
                factor = priority_capacity.CASES[case][1]
                rule = priority_capacity.kept_pairs(probs, experts, priority_capacity.capacity_of(
                    factor, 16, k, rounding=rounding), order)
                found |= not torch.equal(rule, priority_capacity.kept_pairs(probs, experts, C))
        return found
    for order in ("position", "lowest", "weight"):
        assert differs(integer, order) and differs(other, order), order
    assert not differs(integer, rounding=math.floor) and differs(other, rounding=math.floor)
    assert differs(integer, k=1) and differs(other, k=1)


def _priority_outcome(source: str) -> RunOutcome:
    """10.priority_capacity's run, in this process (the exercise communicates nothing): the answer's function
    called through the exercise's driver on each rank's inputs of each case."""
    scope: dict = {}
    exec(compile(submission_source(source), "<cell>", "exec"), scope)
    run = exercise(PRIORITY).runs[0]
    inputs = run.make_inputs(run.nproc)
    return RunOutcome(run.nproc, inputs, [{r: CaseResult(drivers.priority(scope["priority_moe"], *args), [])
                                           for r, args in case.items()} for case in inputs])


@pytest.mark.parametrize("source, lost", [
    (answers.PRIORITY_SOLUTION, {}),
    (answers.PRIORITY_FLOAT64, {}),           # judged by its values, not "Double did not match Float"
    (answers.PRIORITY_LOWEST, {0: "that is the tokens with the smallest largest-probability first",
                               1: "that is the tokens with the smallest largest-probability first"}),
    (answers.PRIORITY_NO_K, {0: "that is the capacity without k (2)", 1: "that is the capacity without k"}),
    (answers.PRIORITY_PER_EXPERT, {0: "that is each expert's highest-weight pairs", 1: "highest-weight pairs"}),
    (answers.PRIORITY_RENORMALISED_RANKING, {0: "that is the tokens ranked by route's renormalised top weight",
                                             1: "rank them by their largest router probability (probs)"}),
], ids=["solution", "float64", "lowest-first", "capacity-without-k", "per-expert-weights", "renormalised-ranking"])
def test_priority_answers_in_one_process_lose_exactly_their_items_named(source, lost):
    outcome = _priority_outcome(source)
    for index, item in enumerate(exercise(PRIORITY).runs[0].items):
        problems = item.judge(outcome)
        if index in lost:
            assert problems and lost[index] in problems[0], (item.name, problems)
            assert re.match(r"rank \d, case \d of 4", problems[0]), problems[0]
        else:
            assert problems == [], (item.name, problems)


def test_the_bytes_judge_names_a_dispatch_packed_with_its_weights():
    # The bytes judge on a ledger with only the combine's [rows, 6] call (the rows went out beside the weights).
    outcome = RunOutcome(2, [{}] * 3, [{r: CaseResult({"returned": "", "forward_end": 10.0}, [
        {"op": "all_to_all_single", "dtype": "float32", "shapes": [[4, 6]], "bytes": 96, "start": 1.0}])
        for r in range(2)} for _ in range(3)])
    message = dedup_dispatch._bytes(outcome)[0]
    assert "1 call)" in message and "only 1 call of [rows, 6] token rows" in message, message
    assert "send the weights in a tensor of their own" in message


def test_dedup_counts_rows_per_token_and_rank_and_the_skewed_case_halves_them():
    experts = torch.tensor([[0, 3], [0, 5], [7, 6]])            # 2 ranks: experts 0-3 on rank 0, 4-7 on rank 1
    assert dedup_dispatch.unique_pairs(experts, 2) == 4
    assert dedup_dispatch.unique_pairs(experts, 2, to=0) == 2
    assert dedup_dispatch.unique_pairs(experts, 4) == 5
    for p in (2, 4):
        sent, received, pairs, pairs_in = dedup_dispatch._visits(p, 1, 0)   # every pair to experts 0 and 1
        assert (sent, pairs) == (16, 32) and received == 16 * p and pairs_in == 32 * p
        assert dedup_dispatch._visits(p, 1, 1)[1] == 0                   # rank 1 receives nothing


def test_the_bytes_judge_reads_only_the_forwards_token_rows():
    calls = [{"op": "all_to_all_single", "dtype": "int64", "shapes": [[2]], "bytes": 16, "start": 1.0},
             {"op": "all_to_all_single", "dtype": "float32", "shapes": [[5, 6]], "bytes": 120, "start": 1.1},
             {"op": "all_to_all_single", "dtype": "float32", "shapes": [[5, 4]], "bytes": 80, "start": 1.2},
             {"op": "all_to_all_single", "dtype": "float32", "shapes": [[7, 6]], "bytes": 168, "start": 3.0}]
    assert [c["bytes"] for c in dedup_dispatch.token_rows(calls, before=2.0)] == [120]


def _balance_outcome(p: int, loss_of, grad_factor: float = 1.0) -> RunOutcome:
    """An outcome whose ranks returned `loss_of(case, rank)` and one process's gradient split so its sum is
    `grad_factor` times one process's."""
    results = []
    for case in range(len(global_balance.CASES)):
        want = global_balance.one_process(case, p)["router"]
        results.append({r: CaseResult({"returned": "", "loss": loss_of(case, r), "router": grad_factor * want / p},
                                      []) for r in range(p)})
    return RunOutcome(p, [{}] * len(results), results)


@pytest.mark.parametrize("p", [2, 4])
def test_the_balance_judges_name_each_slip_of_value_and_factor(p):
    ref = lambda case: global_balance.one_process(case, p)
    value, uneven, gradient = global_balance._items(p)
    right = _balance_outcome(p, lambda case, r: ref(case)["loss"])
    assert [item.judge(right) for item in (value, uneven, gradient)] == [[], [], []]

    def local(case, r):
        return float(global_balance.balance_loss(ref(case)["probs"][r], ref(case)["experts"][r]))
    assert "this rank's own loss" in value.judge(_balance_outcome(p, local))[0]
    for factor, phrase in ((p, "the world size"), (1 / p, f"1 / {p}")):
        assert phrase in gradient.judge(_balance_outcome(p, lambda case, r: ref(case)["loss"], factor))[0]
    if p == 4:
        assert "twice" in gradient.judge(_balance_outcome(p, lambda case, r: ref(case)["loss"], 2))[0]


# On real ranks.

@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_says_what_to_write_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


def _names(template: str) -> tuple[str, str]:
    return template.format(2), template.format(4)


KEPT_INTEGER = "kept: each expert's first C pairs in batch prioritized order, factor · T · k / E an integer (2 ranks)"
KEPT_OTHER = "kept: the same where factor · T · k / E is not an integer, C rounded up (2 ranks)"
KEPT_OUT = "out: the kept pairs at their router weights, dropped pairs adding nothing (2 ranks)"
OUT = _names("out equals one process's, on every case ({} ranks)")
DX = _names("the input's gradient equals one process's ({} ranks)")
ROUTER = _names("the router's gradient, summed over the ranks, equals one process's ({} ranks)")
EXPERT_GRADS = _names("the experts' gradients equal one process's, on each expert's rank ({} ranks)")
BYTES = _names("each token row sent once to each rank holding its experts, and once back: bytes from the ledger "
               "({} ranks)")
VALUE = _names("the loss equals one process's over all ranks' tokens, on every rank, batches of equal size "
               "({} ranks)")
UNEVEN = _names("the same with batches of different sizes ({} ranks)")
BALANCE_GRAD = _names("the router's gradient, summed over the ranks, equals one process's ({} ranks)")

WRONG = [
    pytest.param(PRIORITY, answers.PRIORITY_POSITION, {
        KEPT_INTEGER: ("rank 0, case 1 of 4 (16 tokens, factor 1, C = ceil(1 · 16 · 2 / 8) = 4): you kept",
                       "that is lesson 10's position order"),
        KEPT_OTHER: ("case 3 of 4", "that is lesson 10's position order"),
    }, id="priority-the-lessons-position-order"),
    pytest.param(PRIORITY, answers.PRIORITY_FLOOR, {
        KEPT_OTHER: ("that is the capacity rounded down (4)",),
    }, id="priority-capacity-rounded-down"),
    pytest.param(PRIORITY, answers.PRIORITY_RENORMALISED, {
        KEPT_OUT: ("that is the kept weights renormalised to sum to 1",),
    }, id="priority-kept-weights-renormalised"),
    pytest.param(DEDUP, answers.DEDUP_DUPLICATES, {
        name: ("rank 0, case 1 of 3", "that is one row per (token, expert) pair") for name in BYTES
    }, id="dedup-duplicates-sent"),
    pytest.param(DEDUP, answers.DEDUP_SCORES_TWICE, {
        **{name: ("times its router weight twice, at the expert's rank and again at home",) for name in OUT},
        **{name: ("x's gradient element",) for name in DX},
        **{name: ("the router's gradient summed over ranks",) for name in ROUTER},
        **{name: ("gate_up's gradient element",) for name in EXPERT_GRADS},
    }, id="dedup-scores-applied-twice"),
    pytest.param(DEDUP, answers.DEDUP_COMBINE_NO_AUTOGRAD, {
        name: ("raised: RuntimeError: case 1 of 3", "dedup_moe's out has no autograd graph on this rank")
        for name in OUT + DX + ROUTER + EXPERT_GRADS + BYTES
    }, id="dedup-combine-without-autograd"),
    pytest.param(DEDUP, answers.DEDUP_SKIP_EMPTY, {   # ranks 1..p-1 receive nothing in case 2
        name: ("case 2 of 3", "dedup_moe's out has no autograd graph on this rank",
               "run each local expert even on zero rows") for name in OUT + DX + ROUTER + EXPERT_GRADS + BYTES
    }, id="dedup-experts-with-no-rows-skipped"),
    pytest.param(DEDUP, answers.DEDUP_WEIGHTS_DETACHED, {
        **{name: ("x's gradient element",) for name in DX},
        **{name: ("no gradient reached the router: its weights' path to the output is cut",) for name in ROUTER},
    }, id="dedup-weights-sent-detached"),
    pytest.param(DEDUP, answers.DEDUP_DISPATCH_PLAIN, {
        name: ("x's gradient element", "the dispatch needs the reverse all-to-all in backward") for name in DX
    }, id="dedup-dispatch-without-autograd"),
    pytest.param(GLOBAL, answers.GLOBAL_MEAN_OF_MEANS, {
        **{name: ("case 3 of 3", "that is P as the mean of the ranks' means") for name in UNEVEN},
        **{name: ("case 3 of 3",) for name in BALANCE_GRAD},
    }, id="global-p-as-the-mean-of-the-ranks-means"),
    pytest.param(GLOBAL, answers.GLOBAL_TWICE, {
        BALANCE_GRAD[0]: ("times the world size, 2",),
        BALANCE_GRAD[1]: ("times 2: this rank's probabilities reach the loss twice",),
    }, id="global-all-reduced-p-in-the-graph-twice"),
    pytest.param(GLOBAL, answers.GLOBAL_LOCAL, {
        **{name: ("that is this rank's own loss",) for name in VALUE + UNEVEN},
        **{name: ("case 1 of 3",) for name in BALANCE_GRAD},
    }, id="global-each-ranks-own-loss"),
    pytest.param(GLOBAL, answers.GLOBAL_P_LOCAL, {
        **{name: ("that is f over all ranks but P from this rank's tokens only",) for name in VALUE + UNEVEN},
        BALANCE_GRAD[0]: ("times the world size, 2",),
        BALANCE_GRAD[1]: ("times the world size, 4",),
    }, id="global-p-from-this-ranks-tokens"),
    pytest.param(GLOBAL, answers.GLOBAL_SCALED, {
        BALANCE_GRAD[0]: ("times the world size, 2",),
        BALANCE_GRAD[1]: ("times the world size, 4",),
    }, id="global-own-share-over-own-tokens"),
    # torch's differentiable all_reduce, imported by the cell during the 2-rank run, must use the 4-rank run's
    # group on the same ranks (before the rank server imported it first, 4 ranks hung on the 2-rank group).
    pytest.param(GLOBAL, answers.GLOBAL_NN_ALL_REDUCE, {
        BALANCE_GRAD[0]: ("times the world size, 2",),
        BALANCE_GRAD[1]: ("times the world size, 4",),
    }, id="global-torchs-differentiable-all-reduce"),
    pytest.param(GLOBAL, answers.GLOBAL_ALL_GATHER_UNEVEN, {   # gloo aborts where the batches differ in size
        name: ("was ended by SIGABRT in case 3 of 3 (gloo aborted the process",)
        for name in VALUE + UNEVEN + BALANCE_GRAD
    }, id="global-all-gather-of-probs-uneven-batches"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    got = assert_loses_exactly(exercise_id, source, lost, ranks=ranks)
    for name, message in got.items():
        if name not in ROUTER + BALANCE_GRAD:             # those are about the ranks' sum
            assert re.match(r"rank \d[,: ]", message), message


def test_split_sizes_from_the_senders_view_end_the_run_at_once_named(ranks):
    found = exercise(DEDUP)
    two = dataclasses.replace(found, runs=found.runs[:1])
    items = check_exercise(two, answers.DEDUP_SENDER_VIEW, ranks=ranks)
    assert sum(item.score for item in items) == 0
    assert re.match(r"rank \d was ended by SIGABRT in case 1 of 3 \(gloo aborted the process: .*\d+ bytes arrived "
                    r"where the receiver expected \d+", items[0].message), items[0].message
    assert "did not finish" not in items[0].message


def test_a_right_answer_with_torchs_autograd_all_to_all_scores_full_marks_on_both_runs_of_one_set(ranks):
    # torch.distributed.nn.functional binds its default group at import: imported by the cell in the 2-rank run,
    # it once sent the 4-rank run's calls to the 2-rank run's destroyed group on the same ranks.
    assert "from torch.distributed.nn.functional import all_to_all_single" in answers.DEDUP_NN_FUNCTIONAL
    assert [run.nproc for run in exercise(DEDUP).runs] == [2, 4]
    assert_full_marks(DEDUP, answers.DEDUP_NN_FUNCTIONAL, ranks=ranks)


def test_a_rank_that_skips_the_count_exchange_is_stopped_and_named(ranks):
    found = exercise(DEDUP)
    two = dataclasses.replace(found, runs=found.runs[:1])
    items = check_exercise(two, answers.DEDUP_SKIPS_COUNTS, limits=Limits(run_timeout_s=4), ranks=ranks)
    assert [item.score for item in items] == [0] * len(items)
    assert_deadline_message(items[0].message, 4, 2)
    assert "rank 0 is still in your function: it is waiting in all_to_all_single #1" in items[0].message
    assert "rank 1 finished your function" in items[0].message
