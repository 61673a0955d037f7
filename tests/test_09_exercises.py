"""Lesson 09 (context parallelism): its exercises graded on real gloo ranks.

The solution scores full marks, the stub zero with its hint (shown once per report), and each plausible wrong
answer loses exactly the points its mistake deserves, with a message that names the rank and what is wrong. One
set of grading ranks serves the whole module (as the grader gives one to a submission). A ring that receives
from the rank it sends to is stopped at a short deadline, each rank named waiting in wait(). Single-process
checks of the pieces the judges stand on: the cases' positions and references, the message and overlap readers.
"""

from __future__ import annotations

import dataclasses
import re
import time

import nbformat
import pytest
import torch
import torch.nn.functional as F

import grading_answers_09 as answers
from exercise_checks import (shared_ranks, assert_deadline_message, assert_full_marks, assert_loses_exactly, failed_items,
                             assert_section_states_the_check, assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import assert_lists_exactly, exercise_sections, notebook_path
from course_lib.grading.cells import exercise_cells
from course_lib.grading.checker import check_exercise
from course_lib.grading.lessons.lesson09 import zigzag
from course_lib.grading.lessons.lesson09.common import one_process, positions_of
from course_lib.grading.lessons.lesson09.ring_common import overlap_problem, ring_problem
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line
from course_lib.grading.spec import Limits

NOTEBOOK = "09_context_parallel.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("09")
ONLINE, BACKWARD, ZIGZAG = IDS


ranks = shared_ranks(IDS)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["09.ring_online", "09.ring_backward", "09.zigzag"]
    assert_lists_exactly(notebook, NOTEBOOK, IDS)


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    assert_section_states_the_check(exercise_id, exercise_sections("solutions", NOTEBOOK)[exercise_id])


def test_the_zigzag_section_states_its_cases():
    text = " ".join(exercise_sections("solutions", NOTEBOOK)[ZIGZAG].split())
    assert ", ".join(f"({s}, {p})" for s, p in zigzag.CASES[:3]) in text
    assert ", ".join(f"({s}, {p})" for s, p in zigzag.CASES[3:]) in text


def test_the_solutions_in_the_notebook_are_the_tested_ones():
    for exercise_id, answer in ((ONLINE, answers.RING_ONLINE_SOLUTION), (BACKWARD, answers.RING_BACKWARD_SOLUTION),
                                (ZIGZAG, answers.ZIGZAG_SOLUTION)):
        cell = "\n".join(line for line in SOLUTIONS[exercise_id].splitlines()
                         if "### " not in line and not line.lstrip().startswith('"""'))
        assert cell.strip() == answer.strip(), exercise_id


# Single process: what the judges stand on.

def test_positions_are_the_lessons_chunks_and_the_reference_is_full_attention():
    assert [t.tolist() for t in positions_of(8, 2, False)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [t.tolist() for t in positions_of(8, 2, True)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    ref = one_process(16, 2, 8, True, 0)
    lse = torch.logsumexp((ref["q"] @ ref["k"].transpose(-2, -1) / 8 ** 0.5).masked_fill(
        torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")), -1)
    torch.testing.assert_close(ref["lse"], lse)
    torch.testing.assert_close(ref["out"], F.scaled_dot_product_attention(ref["q"], ref["k"], ref["v"],
                                                                          is_causal=True))


def test_zigzag_reference_is_tensor_splits_chunks_and_the_cases_cover_both_kinds():
    x = zigzag.make_x(10)
    shards = zigzag.reference_split(x, 2)   # chunks of 3, 3, 2, 2 rows
    assert [s[0, 0, :, 0].int().tolist() for s in shards] == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]
    assert {s % (2 * p) == 0 for s, p in zigzag.CASES} == {True, False}
    assert any(s < 2 * p for s, p in zigzag.CASES)   # empty chunks


def test_ring_problem_names_a_second_peer_a_receive_from_the_send_side_and_the_bytes():
    right = [["send", 1, 64, 0, 0], ["recv", 3, 64, 0, 0]]
    assert ring_problem(right, 0, 4, {"send": 64, "recv": 64}, "") == ""
    assert "sent to ranks 1, 3" in ring_problem(right + [["send", 3, 64, 0, 0]], 0, 4, {"send": 64, "recv": 64}, "")
    assert "receives from the neighbour it does not send to" in ring_problem(
        [["send", 1, 64, 0, 0], ["recv", 1, 64, 0, 0]], 0, 4, {"send": 64, "recv": 64}, "")
    assert "sent 64 bytes in 1 message(s); expected 128: why" in ring_problem(right, 0, 4, {"send": 128, "recv": 64},
                                                                             "why")


def test_overlap_needs_a_compute_between_a_receive_and_its_wait():
    posted = {"messages": [["send", 1, 8, 1.0, 1.1, 0], ["recv", 1, 8, 1.0, 1.1, 1]], "waits": [[2.0, 2.1, 1]]}
    assert overlap_problem({**posted, "computes": [1.5]}) == ""
    assert "waited for right after it was posted" in overlap_problem({**posted, "computes": [0.5, 2.5]})
    assert "never waited for" in overlap_problem({**posted, "waits": [], "computes": [1.5]})
    # A wait on the send (Work 0) is not the receive's: the receive is still never waited for.
    assert "never waited for" in overlap_problem({**posted, "waits": [[2.0, 2.1, 0]], "computes": [1.5]})


# On real ranks.

@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


def test_a_ring_of_two_tensors_each_step_scores_full_marks(ranks):
    assert_full_marks(ONLINE, answers.RING_ONLINE_SEPARATE, ranks=ranks)


def test_a_receive_never_waited_for_loses_the_overlap_items_named_and_returns_at_once(ranks):
    # Its buffers may or may not be filled when read (a race), so only the overlap items are certain to be lost;
    # the transfers it never waited for are completed after the function returns, so no run waits for a deadline.
    items = check_exercise(exercise(ONLINE), answers.RING_ONLINE_NO_WAIT, ranks=ranks)
    lost = failed_items(items)
    for name in OVERLAP:
        assert "was never waited for: its buffer may not be filled when you read it" in lost[name], lost.get(name)
    assert all(name in OUT_PLAIN + OUT_CAUSAL + LSE + OVERLAP for name in lost), "\n".join(map(item_line, items))
    assert not any("did not finish" in message for message in lost.values())


def test_a_running_state_in_float64_scores_full_marks(ranks):
    assert_full_marks(ONLINE, answers.RING_ONLINE_FLOAT64, ranks=ranks)


def test_a_send_nobody_receives_is_named_in_seconds_not_blamed_on_load(ranks):
    # gloo never completes it, and a wait that times out closes the pair: the run ends at once, saying which send.
    started = time.monotonic()
    items = check_exercise(exercise(ONLINE), answers.RING_ONLINE_UNMATCHED_SEND, ranks=ranks)
    assert time.monotonic() - started < 2 * exercise(ONLINE).runs[0].timeout_s
    messages = [item.message for item in items if not item.passed]
    assert messages and sum(item.score for item in items) == 0
    assert any(re.search(r"raised: RuntimeError: send \d+ \(to rank \d, [\d,]+ bytes\) was never received: every "
                         r"isend needs a matching irecv on its peer", m) for m in messages), messages
    assert not any("busy" in m or "did not finish" in m for m in messages), messages


def test_a_ring_that_waits_for_its_send_before_the_compute_scores_full_marks(ranks):
    # Its receive is in flight during the compute: the overlap judge pairs each receive with the wait on its own Work.
    assert_full_marks(ONLINE, answers.RING_ONLINE_SEND_WAITED_FIRST, ranks=ranks)


def test_torch_logsumexp_is_refused_in_one_line(ranks):
    items = check_exercise(exercise(ONLINE), answers.RING_ONLINE_LOGSUMEXP, ranks=ranks)
    assert sum(item.score for item in items) == 0
    for item in items:
        assert re.fullmatch(r"rank \d raised at cell line \d+: RuntimeError: torch.logsumexp is not allowed here: "
                            r"carry each query row's running max and sum of exponentials yourself \(lse = m \+ "
                            r"log\(l\)\)", item.message), item.message


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_says_what_to_write_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


def _names(template: str) -> tuple[str, str]:
    return template.format(2), template.format(4)


OUT_PLAIN = _names("out equals one process's attention, no mask ({} ranks)")
OUT_CAUSAL = _names("out equals one process's causal attention, contiguous and zigzag splits ({} ranks)")
LSE = _names("lse equals each query row's log-sum-exp, on every case ({} ranks)")
TRANSFERS = _names("p - 1 transfers of k and v, to one neighbour and from the other ({} ranks)")
OVERLAP = _names("every transfer in flight while the rank computes: posted before, waited after ({} ranks)")
DQ = _names("dq equals one process's, on every case ({} ranks)")
DK = _names("dk equals one process's, on the block's owner ({} ranks)")
DV = _names("dv equals one process's, on the block's owner ({} ranks)")
AROUND = _names("around the ring: k, v p - 1 hops, dk, dv p hops, one neighbour each way ({} ranks)")
SPLIT_EVEN = "split: rank r holds chunks r and 2p - 1 - r, on lengths 2p divides (2 ranks)"
SPLIT_UNEVEN = "split: the same with tensor_split's chunk sizes, on lengths 2p does not divide (2 ranks)"
MERGE_EVEN = "merge: the sequence back from the p shards, on lengths 2p divides (2 ranks)"
MERGE_UNEVEN = "merge: the same on lengths 2p does not divide (2 ranks)"

WRONG = [
    pytest.param(ONLINE, answers.RING_ONLINE_MAX_NOT_CARRIED, {
        **{name: ("rank 0, case 1 of 3 (2 ranks, s = 16, no mask, contiguous split): out differs",)
           for name in OUT_PLAIN[:1]},
        OUT_PLAIN[1]: ("case 1 of 3 (4 ranks, s = 32, no mask",),
        **{name: ("case 2 of 3",) for name in OUT_CAUSAL},
        **{name: ("lse of head 0, row 0",) for name in LSE},
    }, id="online-max-not-carried-between-blocks"),
    pytest.param(ONLINE, answers.RING_ONLINE_MASK_WRONG_SIDE, {
        **{name: ("causal, contiguous split): out differs",
                  "it is attention over the keys at or after each query: the mask is on the wrong side")
           for name in OUT_CAUSAL},
        **{name: ("the log-sum-exp over the keys at or after each query",) for name in LSE},
    }, id="online-causal-mask-on-the-wrong-side"),
    pytest.param(ONLINE, answers.RING_ONLINE_BLOCK_SKIP_WRONG_SIDE, {
        **{name: ("rank 1, case 2 of 3", "causal, contiguous split): out differs") for name in OUT_CAUSAL},
        **{name: ("rank 1, case 2 of 3",) for name in LSE},
    }, id="online-whole-blocks-skipped-on-the-wrong-side"),
    pytest.param(ONLINE, answers.RING_ONLINE_LSE_WITHOUT_MAX, {
        name: ("lse of head 0, row 0", "that is log(l) without the running max") for name in LSE
    }, id="online-lse-without-the-running-max"),
    pytest.param(ONLINE, answers.RING_ONLINE_WAIT_AT_ONCE, {
        OVERLAP[0]: ("rank 0, case 1 of 3", "receive 1 (from rank 1) was waited for right after it was posted"),
        OVERLAP[1]: ("receive 1 (from rank 3) was waited for right after it was posted",),
    }, id="online-transfer-waited-before-the-compute"),
    pytest.param(ONLINE, answers.RING_ONLINE_BLOCKING, {
        OVERLAP[0]: ("receive 1 (from rank 1) was waited for right after it was posted", "dist.send and dist.recv wait"),
        OVERLAP[1]: ("receive 1 (from rank 3) was waited for right after it was posted",),
    }, id="online-blocking-send-and-recv"),
    pytest.param(ONLINE, answers.RING_ONLINE_EXTRA_HOP, {
        TRANSFERS[0]: ("sent 2,048 bytes in 2 message(s); expected 1,024: p - 1 transfers",),
        TRANSFERS[1]: ("sent 4,096 bytes in 4 message(s); expected 3,072",),
    }, id="online-block-sent-at-the-last-step-too"),
    pytest.param(BACKWARD, answers.RING_BACKWARD_NO_ROW_DOT, {
        **{name: ("rank 0, case 1 of 3", "dq differs from one process's") for name in DQ},
        **{name: ("dk differs from one process's",) for name in DK},
    }, id="backward-without-the-row-dot-term"),
    pytest.param(BACKWARD, answers.RING_BACKWARD_ONE_HOP_SHORT, {
        **{name: ("it is rank 1's dk, the block's accumulator stopped one hop short of its owner",) for name in DK},
        **{name: ("it is rank 1's dv",) for name in DV},
        AROUND[0]: ("sent 2,048 bytes in 2 message(s); expected 3,072: k and v sent p - 1 = 1 times",),
        AROUND[1]: ("sent 6,144 bytes in 6 message(s); expected 7,168",),
    }, id="backward-accumulator-one-hop-short"),
    pytest.param(BACKWARD, answers.RING_BACKWARD_DK_UNSCALED, {
        name: ("dk differs from one process's",) for name in DK
    }, id="backward-dk-without-the-score-scale"),
    pytest.param(ZIGZAG, answers.ZIGZAG_CHUNK, {
        SPLIT_UNEVEN: ("zigzag_split(x, 3) with s = 13: shard 0 holds the rows at positions [0, 1, 2, 12]",
                       "2p = 6 does not divide s = 13: tensor_split's chunks have 3 rows for the first 1, 2 after"),
    }, id="zigzag-torch-chunk"),
    pytest.param(ZIGZAG, answers.ZIGZAG_WRONG_END, {
        SPLIT_EVEN: ("rank 0, zigzag_split(x, 2) with s = 8: shard 0 holds the rows at positions [0, 1, 2, 3]; "
                     "expected [0, 1, 6, 7] (chunks 0 and 3 of 4)",),
        SPLIT_UNEVEN: ("(chunks 0 and 5 of 6)",),
    }, id="zigzag-second-chunk-from-the-wrong-end"),
    pytest.param(ZIGZAG, answers.ZIGZAG_MERGE_RANK_ORDER, {
        MERGE_EVEN: ("returned the rows at positions [0, 1, 6, 7, 2, 3, 4, 5]; expected 0 to 7 in order",),
        MERGE_UNEVEN: ("of s = 13",),
    }, id="zigzag-merge-in-rank-order"),
    pytest.param(ZIGZAG, answers.ZIGZAG_MERGE_FLOOR, {
        MERGE_UNEVEN: ("zigzag_merge raised RuntimeError: split_with_sizes expects split_sizes to sum exactly",),
    }, id="zigzag-merge-with-equal-chunks"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    got = assert_loses_exactly(exercise_id, source, lost, ranks=ranks)
    for message in got.values():
        assert re.match(r"rank \d[,: ]", message), message


def test_a_ring_receiving_from_the_rank_it_sends_to_is_stopped_and_named(ranks):
    # On 4 ranks every irecv waits for a block its peer sends elsewhere: a deadlock, named at a short deadline.
    found = exercise(ONLINE)
    four = dataclasses.replace(found, runs=found.runs[1:])
    items = check_exercise(four, answers.RING_ONLINE_RECEIVE_FROM_AFTER, limits=Limits(run_timeout_s=6),
                           ranks=ranks)
    assert [item.score for item in items] == [0] * len(items)
    assert_deadline_message(items[0].message, 6, 4)
    assert ("ranks 0, 1, 2, 3 are still in your function: they are waiting in wait() at cell line "
            in items[0].message), items[0].message
    assert "on a transfer posted by batch_isend_irecv #1" in items[0].message, items[0].message
