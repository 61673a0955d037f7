"""Lesson 10 (mixture of experts, expert parallelism): `cl.draw_flow` (a p x p matrix per step, its row and
column sums), and the predictions' measures against their formulas (the dispatch and combine bytes, the pairs
dropped at a capacity and its explanation built from the run's counts, the padded dispatch's bytes, the number an
expert's gradient summed over its column under EP x DP must be divided by).

Fast, single-process: the lesson's runs themselves are checked under nbval (notebooks/10_moe_expert_parallel.ipynb).
"""

from __future__ import annotations

import pytest

import course_lib as cl
from course_lib.draw.figures import overflow_inches
from course_lib.predictions import LESSONS, all_predictions, prediction
from course_lib.predictions.lesson10 import capacity, column_divisor, dropped, float_all_to_alls


def test_draw_flow_prints_each_step_with_what_every_rank_sent_and_received(capsys):
    view = cl.draw_flow({0: [[3, 5], [2, 0]], 1: [[8, 0], [0, 0]]}, title="t", unit="rows")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 0: rows sent (row: from rank, column: to rank)"
    assert out[2].split() == ["rank", "0", "3", "5", "8"] and out[4].split() == ["received", "5", "5"]
    assert view.sent == {0: [8, 2], 1: [8, 0]} and view.received == {0: [5, 5], 1: [8, 0]}
    assert len(view.fig.axes) == 2 and [a.get_title() for a in view.fig.axes] == ["step 0", "step 1"]
    assert overflow_inches(view.fig) == 0.0


@pytest.mark.parametrize("steps, says", [({}, "no steps"), ({0: [[1, 2]]}, "p x p"), ({0: [[1, -1], [0, 0]]}, "negative"),
                                         ({0: [[1]], 1: [[1, 0], [0, 1]]}, "same number of ranks")])
def test_draw_flow_names_bad_input_in_one_line(steps, says):
    with pytest.raises(ValueError, match=says) as raised:
        cl.draw_flow(steps, quiet=True)
    assert "\n" not in str(raised.value)


def test_the_lessons_predictions_are_registered():
    assert "10" in LESSONS
    assert sorted(p for p in all_predictions() if p.startswith("10.")) == [
        "10.capacity_bytes", "10.dropped", "10.ep_bytes", "10.expert_grad_divisor"]


def _a2a(*rows: int, dtype: str = "float32") -> list[dict]:
    """all_to_all_single records of `rows` rows of 8 float32 each, after a count exchange (int64)."""
    counts = {"op": "all_to_all_single", "dtype": "int64", "bytes": 64}
    return [counts] + [{"op": "all_to_all_single", "dtype": dtype, "bytes": n * 8 * 4} for n in rows]


def test_ep_bytes_reads_step_ones_dispatch_and_combine_and_catches_a_dispatch_of_each_token_once():
    spec = prediction("10.ep_bytes")
    results = {"ep2": {r: {"tokens": 16, "hidden": 8, "k": 2} for r in range(2)}}
    step0 = [32, 30, 30, 32]                         # dispatch, combine, their backward
    ledgers = {0: _a2a(*step0) + [{"op": "barrier"}] + _a2a(32, 64, 64, 32)}
    assert [c["bytes"] for c in float_all_to_alls(ledgers[0])][4:6] == [1024, 2048]
    assert spec.measure(results, ledgers) == spec.formula(results) == (1024, 2048)
    once = {0: _a2a(*step0) + _a2a(16, 32, 32, 16)}  # each token sent once, not once per expert
    assert spec.measure(results, once) != spec.formula(results)


def test_dropped_is_what_each_expert_cannot_take_and_the_run_must_agree():
    assert capacity(1.0, 16, 2, 8) == 4 and capacity(1.25, 16, 2, 8) == 5 and capacity(2.0, 16, 2, 8) == 8
    assert dropped([6, 4, 4, 4, 2, 5, 2, 5], 4) == 4 and dropped([4] * 8, 4) == 0
    spec = prediction("10.dropped")
    run = {"factors": (1.0, 1.25, 2.0), "tokens": 16, "k": 2, "experts": 8, "counts": [6, 4, 4, 4, 2, 5, 2, 5]}
    results = {"capacity": {0: {**run, "dropped": [4, 1, 0]}}}
    assert spec.measure(results, {}) == spec.formula(results) == 4
    results["capacity"][0]["dropped"] = [3, 1, 0]    # a run that dropped by another rule
    assert spec.measure(results, {}) != spec.formula(results)


def test_capacity_bytes_is_the_padded_buffer_whatever_the_routing():
    spec = prediction("10.capacity_bytes")
    run = {"factors": (1.0, 1.25, 2.0), "tokens": 16, "k": 2, "experts": 8, "hidden": 8}
    results = {"capacity": {0: run}}
    ledgers = {0: [{"op": "all_to_all_single", "dtype": "float32", "bytes": 8 * c * 8 * 4} for c in (4, 4, 5, 5, 8, 8)]}
    assert spec.measure(results, ledgers) == spec.formula(results) == 1280
    unpadded = {0: [{"op": "all_to_all_single", "dtype": "float32", "bytes": 29 * 32}] * 6}   # only the kept pairs
    assert spec.measure(results, unpadded) != spec.formula(results)


def test_expert_grad_divisor_is_the_world_size_and_catches_a_sum_over_the_row_only():
    import torch

    one = [torch.arange(1.0, 7.0).view(2, 3), torch.tensor([0.5, -2.0])]   # one process's gradients, any values
    spec = prediction("10.expert_grad_divisor")
    mesh = {"dp_mod_ep": 2, "ep": 2}
    run = {"mesh": mesh, "summed": [4 * g for g in one], "one_process": one}   # the column's sum: all 4 ranks' losses
    assert column_divisor(run["summed"], one) == 4.0
    assert spec.measure({"epdp": {0: run}}, {}) == spec.formula({"epdp": {0: run}}) == 4.0
    row_only = {**run, "summed": [2 * g for g in one]}                     # no all_reduce over the column
    assert spec.measure({"epdp": {0: row_only}}, {}) != spec.formula({"epdp": {0: row_only}})
    wide = {"mesh": {"dp_mod_ep": 2, "ep": 4}, "summed": [8 * g for g in one], "one_process": one}   # 8 ranks, ep 4
    assert spec.measure({"epdp": {0: wide}}, {}) == spec.formula({"epdp": {0: wide}}) == 8.0


def test_dropped_explanation_does_the_arithmetic_on_the_runs_counts():
    from course_lib.predictions.reveal import reveal

    run = {"factors": (1.0, 1.25, 2.0), "tokens": 16, "k": 2, "experts": 8, "counts": [3, 3, 6, 3, 4, 3, 3, 7],
           "dropped": [5, 1, 0]}
    text = " ".join(reveal("10.dropped", 5, {"capacity": {0: run}}, {}).split())
    assert "[3, 3, 6, 3, 4, 3, 3, 7]: (6 - 4) + (7 - 4) = 5" in text and "right" in text
