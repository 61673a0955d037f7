"""Lesson 08 (pipeline parallelism), part 1: `cl.draw_schedule`'s data on timelines whose idle time is known,
the slot placement behind `08.idle_slots`, and the predictions' measures against their formulas.

Fast, single-process: the lesson's runs themselves are checked under nbval (notebooks/08_pipeline.ipynb).
"""

from __future__ import annotations

import math

import pytest

import course_lib as cl
from course_lib.draw.figures import overflow_inches
from course_lib.predictions import LESSONS, all_predictions, prediction
from course_lib.predictions.lesson08 import SCHEDULES, slots

# The orders the lesson's launches run (section 4: p = 2, m = 4; section 5: p = 4, m = 8).
GPIPE_2 = {rank: "F0 F1 F2 F3 B0 B1 B2 B3" for rank in range(2)}
ONE_F_ONE_B_2 = {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}
GPIPE_4 = {rank: " ".join([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)]) for rank in range(4)}
ONE_F_ONE_B_4 = {0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                 1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                 2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                 3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"}


def _timelines(orders: dict[int, str], slot_s: float = 0.01, origin: float = 1234.5) -> dict:
    """What ranks would publish if every action lasted one slot: (kind, microbatch, start, end)."""
    return {rank: [(action[0], int(action[1:]), origin + start * slot_s, origin + (start + 1) * slot_s)
                   for action, start in placed] for rank, placed in slots(orders).items()}


def test_draw_schedule_returns_busy_idle_and_bubble_of_a_hand_made_run():
    # Rank 0: F0 [0, 1], F1 [1, 2], then waits, B1 [5, 7], B0 [7, 9]. Rank 1 starts later and ends earlier.
    timelines = {0: [("B", 1, 105.0, 107.0), ("F", 0, 100.0, 101.0), ("F", 1, 101.0, 102.0), ("B", 0, 107.0, 109.0)],
                 1: [("F", 0, 101.5, 102.5), ("F", 1, 102.5, 103.0), ("B", 1, 103.0, 104.5)]}
    view = cl.draw_schedule(timelines, title="hand-made", quiet=True)
    assert view.span_s == pytest.approx(9.0)                   # from 100 (rank 0's F0) to 109 (its B0)
    zero, one = view.stats[0], view.stats[1]
    assert zero.busy_s == pytest.approx(6.0) and zero.idle_s == pytest.approx(3.0)
    assert zero.bubble == pytest.approx(3 / 9) and zero.order == ("F0", "F1", "B1", "B0")  # sorted by start
    assert one.busy_s == pytest.approx(3.0) and one.idle_s == pytest.approx(0.0)      # no gap between its own
    assert one.bubble == pytest.approx(6 / 9)                                           # ... but idle 6 of 9
    assert view.bubble == pytest.approx((3 / 9 + 6 / 9) / 2)
    assert view.lines == ["rank 0: F0 F1 B1 B0", "rank 1: F0 F1 B1"]
    assert min(b.start for b in view.boxes) == 0.0 and len(view.boxes) == 7
    assert overflow_inches(view.fig) == 0.0                    # the title, labels and legend fit in the PNG


def test_draw_schedule_prints_each_ranks_order_only(capsys):
    cl.draw_schedule({1: [("F", 0, 2.0, 3.0)], 0: [("F", 0, 0.5, 1.5), ("W", 0, 4.0, 4.5)]})
    assert capsys.readouterr().out == "rank 0: F0 W0\nrank 1: F0\n"   # no timing: stable under nbval


@pytest.mark.parametrize("timelines, says", [
    ({}, "no timelines"),
    ({0: [("F", 0, 1.0)]}, r"is not \(kind, microbatch, start, end\)"),
    ({0: [("X", 0, 1.0, 2.0)]}, "kind 'X'"),
    ({0: [("F", 3, 2.0, 1.0)]}, "F3 ends before it starts"),
])
def test_draw_schedule_says_what_is_wrong_with_its_input_in_one_line(timelines, says):
    with pytest.raises(ValueError, match=says) as raised:
        cl.draw_schedule(timelines, quiet=True)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("orders, p, m", [(GPIPE_2, 2, 4), (ONE_F_ONE_B_2, 2, 4), (GPIPE_4, 4, 8),
                                          (ONE_F_ONE_B_4, 4, 8)], ids=["GPipe 2x4", "1F1B 2x4", "GPipe 4x8", "1F1B 4x8"])
def test_unit_slots_give_the_textbook_bubble_on_every_rank(orders, p, m):
    placed = slots(orders)
    step = max(start + 1 for actions in placed.values() for _, start in actions)
    assert step == 2 * (m + p - 1)
    view = cl.draw_schedule(_timelines(orders), quiet=True)
    for rank, stats in view.stats.items():
        assert stats.bubble == pytest.approx((p - 1) / (m + p - 1)), rank
        assert stats.busy_s == pytest.approx(2 * m * 0.01)
    assert view.stats[0].idle_s == pytest.approx(2 * (p - 1) * 0.01)    # rank 0 spans the whole step


def test_slots_follow_the_dependencies_and_refuse_orders_that_wait_forever():
    placed = dict(slots(GPIPE_2)[1])
    assert placed["F0"] == 1 and placed["B0"] == 5           # after rank 0's F0; after its own F3 (slot 4)
    assert dict(slots(GPIPE_2)[0])["B0"] == 6                # after rank 1's B0
    with pytest.raises(ValueError, match="wait on each other forever"):
        slots({0: "F0 B0 F1 B1", 1: "F1 B1 F0 B0"})              # rank 1 waits for F1 first, rank 0 for B0


def _four(orders_by_schedule: dict[str, dict[int, str]], peaks: dict[str, tuple]) -> dict:
    return {"four": {rank: {name: {"order": orders[rank], "peak": peaks[name][rank]}
                            for name, orders in orders_by_schedule.items()} for rank in range(4)}}


def test_the_lessons_predictions_are_registered_with_a_reveal_each():
    assert "08" in LESSONS
    assert sorted(p for p in all_predictions() if p.startswith("08.")) == [
        "08.boundary_bytes", "08.idle_slots", "08.peak_microbatches"]


def test_idle_slots_measured_from_the_orders_equals_the_formula_and_catches_another_order():
    spec = prediction("08.idle_slots")
    results = _four(dict(zip(SCHEDULES, (GPIPE_4, ONE_F_ONE_B_4))), {name: (8, 8, 8, 8) for name in SCHEDULES})
    assert spec.measure(results, {}) == spec.formula(results) == (6, 6)
    # Rank 0 running its backwards in reverse under GPipe waits longer: the measure sees it.
    late = {**GPIPE_4, 0: " ".join([f"F{i}" for i in range(8)] + [f"B{i}" for i in reversed(range(8))])}
    worse = _four(dict(zip(SCHEDULES, (late, ONE_F_ONE_B_4))), {name: (8,) * 4 for name in SCHEDULES})
    assert spec.measure(worse, {})[0] > 6


def test_peak_microbatches_measures_what_rank_0_published():
    spec = prediction("08.peak_microbatches")
    results = _four(dict(zip(SCHEDULES, (GPIPE_4, ONE_F_ONE_B_4))), {SCHEDULES[0]: (8, 8, 8, 8),
                                                                    SCHEDULES[1]: (4, 3, 2, 1)})
    assert spec.measure(results, {}) == spec.formula(results) == (8, 4)
    results["four"][0][SCHEDULES[1]]["peak"] = 8                  # a 1F1B that held everything
    assert spec.measure(results, {}) != spec.formula(results)


def test_boundary_bytes_reads_the_ledgers_send_and_recv_records():
    spec = prediction("08.boundary_bytes")
    results = {"naive": {0: {"boundary": [16, 16]}, 1: {"boundary": [16, 16]}}}
    ledgers = {0: [{"op": "barrier", "bytes": 0}, {"op": "send", "bytes": 1024}, {"op": "recv", "bytes": 1024}],
                1: [{"op": "recv", "bytes": 1024}, {"op": "send", "bytes": 1024}]}
    assert spec.measure(results, ledgers) == spec.formula(results) == (4 * math.prod((16, 16)),) * 2
    ledgers[0].append({"op": "send", "bytes": 1024})               # a second send: twice the bytes
    assert spec.measure(results, ledgers) != spec.formula(results)
