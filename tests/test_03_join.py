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
from exercise_checks import (shared_ranks,
    assert_full_marks, assert_hang_is_named, assert_loses_exactly, assert_section_states_the_check,
    assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import notebook_path, exercise_sections, markdown_cells
from course_lib.grading.cells import EXERCISE_ID, exercise_cells
from course_lib.grading.checker import check_exercise, preload_for
from course_lib.grading.lessons.lesson02.exercises import ATOL, RTOL, _batch, _sgd_step, _weights
from course_lib.grading.lessons.lesson03.exercises import (
    ADAM_LR, LR, ZERO1_DEFAULTS, first_out, greedy_owners, join_reference)
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = "03_join.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("03")
JOIN, COUNTER, ZERO, ZERO1 = IDS
HANG_S = 4  # the deadline of a run that hangs: long enough for the steps before the hang


ranks = shared_ranks(IDS)


def _markdown(notebook: str) -> list[str]:
    return markdown_cells(notebook, NOTEBOOK)


def _sections(notebook: str) -> dict[str, str]:
    return exercise_sections(notebook, NOTEBOOK)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["03.join_uneven_training", "03.counting_joinable", "03.zero_sharded_checkpoint", "03.zero1_by_hand"]
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
    if exercise_id == ZERO1:
        steps, rows = len(case[0][1]), case[0][1][0][0].shape[0]
        name, defaults = case[0][2], case[0][3]
        options = ", ".join(f"{k}={v:g}" for k, v in defaults.items())
        return [f"`torch.optim.{name}({options})`", f"{steps} steps of {rows} rows per rank"]
    _, before, after, world_save, world_load, _, _ = case[0]
    rows_before, rows_after = 12 // world_save, 12 // world_load
    if world_load == world_save:
        return [f"{len(before)} steps of {rows_before} rows per rank on {world_save} ranks, saved, then "
                f"{len(after)} more steps on the same {world_load} ranks"]
    on = {2: "on ranks 0 and 1", 3: "on all 3 ranks"}
    saved = (f"{len(before)} steps of {rows_before} rows per rank "
             + (f"on {world_save} ranks" if world_save == n else on[world_save]) + ", saved")
    return [saved, f"then {len(after)} more steps {on[world_load]} ({rows_after} rows each)"]


def _power(tolerance: float) -> str:
    """A tolerance as the text writes it: 1e-05 -> "1e-5"."""
    return f"{tolerance:.0e}".replace("e-0", "e-")


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    """What the checks enforce (lesson03.py, rank_runner's blocked calls), as the learner reads it."""
    text = _sections("solutions")[exercise_id]
    assert_section_states_the_check(exercise_id, text, _case_phrases)
    if exercise_id == JOIN:
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text and f"lr {LR:g}" in text
    if exercise_id == ZERO:
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text and f"lr={ADAM_LR:g}" in text
        assert "none inside `save_shards`" in text and "Each step's batch has 12 rows" in text
    if exercise_id == ZERO1:
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text
        assert ZERO1_DEFAULTS == {"Adam": {"lr": ADAM_LR}, "SGD": {"lr": 0.1, "momentum": 0.9}}


def test_the_lessons_model_and_data_are_the_definitions_its_cells_held():
    """Lesson 03's cells import make_mlp and make_batches from course_lib.models; before, each cell defined
    them (below, as they were): the same parameter names and values, the same batches for every rank."""
    import torch

    from course_lib.models import make_batches, make_mlp

    def old_make_mlp():
        torch.manual_seed(0)   # the same weights in every process that calls it
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def old_make_batches(rank, count, size=4):
        generator = torch.Generator().manual_seed(100 + rank)
        return [(torch.randn(size, 8, generator=generator), torch.randn(size, 4, generator=generator))
                for _ in range(count)]

    new, old = dict(make_mlp().named_parameters()), dict(old_make_mlp().named_parameters())
    assert list(new) == list(old) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(torch.equal(new[name], old[name]) for name in new)
    for rank, count in ((0, 2), (1, 3)):
        for (x, y), (x_old, y_old) in zip(make_batches(rank, count), old_make_batches(rank, count), strict=True):
            assert torch.equal(x, x_old) and torch.equal(y, y_old)


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
QUIET_2, SAME_2, QUIET_3, FEWER_3, MORE_3 = (
    "save_shards makes no collective: each rank writes the state it holds (2 ranks)",
    "saved on 2 ranks, loaded on the same 2: 2 more steps give one process's Adam after 5 steps",
    "save_shards makes no collective: each rank writes the state it holds (3 ranks)",
    "saved on 3 ranks, loaded on 2: 2 more steps give one process's Adam after 4 steps",
    "saved on 2 ranks, loaded on 3: 2 more steps give one process's Adam after 4 steps")
ADAM_2, SGD_2, SHARE_2, ADAM_3, SHARE_3 = (
    "parameters equal one process's Adam after 3 steps, on every rank (2 ranks)",
    "parameters equal one process's SGD with momentum after 3 steps (2 ranks)",
    "each rank's optimizer state is its greedy share, in bytes (2 ranks)",
    "parameters equal one process's Adam after 3 steps, on every rank (3 ranks)",
    "each rank's optimizer state is its greedy share, in bytes (3 ranks)")
SHARED_ADAM, SHARED_SHARE = (
    "with a frozen and a tied parameter: parameters equal one process's Adam after 3 steps (2 ranks)",
    "with a frozen and a tied parameter: each rank's optimizer state is its greedy share (2 ranks)")
# (The ledger numbers a rank's calls over the runs its process served: the number after '#' depends on them.)
GATHERS = ("each rank writes the state it holds, without communicating: gathering every share on one rank (as "
           "consolidate_state_dict does) needs that rank to hold the whole state at once")
OTHER_INDEX = ("that state belongs to another parameter; the inner optimizer numbers its own parameters 0, 1, ... on "
               "every rank, while a plain optimizer's state_dict numbers every parameter of the model")
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
    # Lesson 03's consolidate_state_dict: resumes right on any number of ranks, but gathers while saving.
    pytest.param(ZERO, answers.ZERO_CONSOLIDATES, {
        QUIET_2: GATHERS,
        QUIET_3: "rank 0, case 1 of 2 (2 Adam steps on 3 ranks, saved, 2 more after loading on 2): save_shards "
                 "called broadcast",
    }, id="zero-gathers-on-rank-0"),
    pytest.param(ZERO, answers.ZERO_LOCAL_INDEX, {
        SAME_2: "rank 0, case 1 of 1 (3 Adam steps on 2 ranks, saved, 2 more after loading on 2): after load_shards, "
                "the state of 0.weight holds exp_avg of shape [2, 6], its parameter has shape [6, 4]: " + OTHER_INDEX,
        FEWER_3: "the state of 0.weight holds exp_avg of shape [6], its parameter has shape [6, 4]",
        MORE_3: OTHER_INDEX,
    }, id="zero-keyed-by-the-inner-index"),
    # Right on the same ranks; on others, a rank owns parameters whose state another rank saved.
    pytest.param(ZERO, answers.ZERO_OWN_FILE_ONLY, {
        FEWER_3: "rank 0, case 1 of 2 (2 Adam steps on 3 ranks, saved, 2 more after loading on 2): after resuming, "
                 "0.weight element [0, 0] is 0.398868, expected 0.398817: that is each rank reading only its own "
                 "file: the owners change with the number of ranks (on 3, rank 0: 0.weight; rank 1: 2.weight; "
                 "rank 2: 0.bias, 2.bias; on 2, rank 0: 0.weight; rank 1: 0.bias, 2.weight, 2.bias), so a rank "
                 "needs the shares other ranks saved",
        MORE_3: "that is each rank reading only its own file",
    }, id="zero-each-rank-reads-its-own-file"),
    pytest.param(ZERO, answers.ZERO_RANK_0_SAVES, {
        name: "that is the state of rank 0's share alone: the parameters the other ranks owned resumed from zero "
              "moments; every rank saves its own share" for name in (SAME_2, FEWER_3, MORE_3)
    }, id="zero-rank-0-saves-alone"),
    pytest.param(ZERO, answers.ZERO_LOADS_NOTHING, {
        SAME_2: "rank 0, case 1 of 1 (3 Adam steps on 2 ranks, saved, 2 more after loading on 2): after resuming, "
                "0.weight element [0, 0] is 0.132777, expected 0.120231: that is Adam resumed with no state at all",
        FEWER_3: "that is Adam resumed with no state at all",
        MORE_3: "that is Adam resumed with no state at all",
    }, id="zero-loads-nothing"),
    pytest.param(ZERO1, answers.ZERO1_STEPS_EVERYTHING, {
        SHARE_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): optim.state "
                 "holds 368 B, the state of every parameter: every rank steps everything, nothing is sharded; the "
                 "greedy split (largest first, each to the rank holding the fewest elements so far, the lowest rank "
                 "on a tie) gives rank 0 0.weight: 196 B",
        SHARE_3: "optim.state holds 368 B, the state of every parameter: every rank steps everything",
        SHARED_SHARE: "0.weight frozen, 4.weight tied to 2.weight): optim.state holds 568 B, the state of every "
                      "parameter",
    }, id="zero1-every-rank-steps-everything"),
    pytest.param(ZERO1, answers.ZERO1_NO_BROADCAST, {
        ADAM_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): 0.bias still "
                f"holds its initial value; rank 1 stepped it {NOT_SENT} to every other rank",
        SGD_2: NOT_SENT,
        ADAM_3: f"0.bias still holds its initial value; rank 2 stepped it {NOT_SENT}",
        SHARED_ADAM: f"2.bias still holds its initial value; rank 1 stepped it {NOT_SENT}",
    }, id="zero1-no-broadcast"),
    pytest.param(ZERO1, answers.ZERO1_NOT_AVERAGED, {
        ADAM_2: "rank 0, case 1 of 2 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step): 0.weight "
                f"element [0, 0] is -0.266174, expected -0.265075: {OWN_ROWS} over the ranks before stepping",
        SGD_2: OWN_ROWS,
        ADAM_3: OWN_ROWS,
        SHARED_ADAM: f"4.weight tied to 2.weight): 0.bias element 0 is 0.20676, expected 0.229451: {OWN_ROWS}",
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
        SHARED_SHARE: "optim.state holds 364 B (the state of 0.weight, 2.weight, 4.bias, 6.bias); the greedy split "
                      "(largest first, each to the rank holding the fewest elements so far, the lowest rank on a tie) "
                      "gives rank 0 0.bias, 2.weight, 4.bias: 396 B",
    }, id="zero1-round-robin-partition"),
    pytest.param(ZERO1, answers.ZERO1_WRAPS_TORCHS, {
        name: "RuntimeError: ZeroRedundancyOptimizer is what this exercise asks you to build: it is not allowed here"
        for name in (ADAM_2, SGD_2, SHARE_2, ADAM_3, SHARE_3, SHARED_ADAM, SHARED_SHARE)
    }, id="zero1-wraps-torchs-zero"),
    pytest.param(ZERO1, answers.ZERO1_NONE_GRADIENT, {
        name: ("rank 0 raised at cell line", "RuntimeError: TypeError: Invalid function argument. Expected parameter "
               "`tensor` of type torch.Tensor (in this case the module's 0.weight is frozen (requires_grad=False: no "
               "hook, its .grad stays None)")
        for name in (SHARED_ADAM, SHARED_SHARE)
    }, id="zero1-all-reduces-a-none-gradient"),
    pytest.param(ZERO1, answers.ZERO1_SPLITS_TRAINABLE_ONLY, {
        SHARED_SHARE: "rank 0, case 1 of 1 (torch.optim.Adam(lr=0.01), 3 steps, 4 rows per rank per step, 0.weight "
                      "frozen, 4.weight tied to 2.weight): optim.state holds 292 B, the greedy split of the parameters that "
                      "require a gradient only; split every parameter given, frozen ones included, as "
                      "ZeroRedundancyOptimizer does",
    }, id="zero1-splits-the-trainable-parameters-only"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    assert_loses_exactly(exercise_id, source, lost, ranks=ranks)


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
