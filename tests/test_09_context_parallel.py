"""Lesson 09 (context parallelism): `cl.draw_schedule` with kinds of the caller's own (the ring's post, compute
and wait), the causal tile count behind `09.causal_tiles` against a count over real positions, and the
predictions' measures against their formulas (the ring's bytes, scores, tiles and Ulysses' all-to-all bytes).

Fast, single-process: the lesson's runs themselves are checked under nbval (notebooks/09_context_parallel.ipynb).
"""

from __future__ import annotations

import pytest

import course_lib as cl
from course_lib.draw.figures import overflow_inches
from course_lib.predictions import LESSONS, all_predictions, prediction
from course_lib.predictions.lesson09 import causal_tiles, kept_isends, sent_to_others

RING_KINDS = {"P": ("#fd8d3c", "transfer posted"), "C": ("#9ecae1", "compute"), "R": ("#3182bd", "wait")}


def test_draw_schedule_draws_kinds_the_caller_names_and_returns_their_data(capsys):
    timelines = {0: [("P", 0, 10.0, 10.1), ("C", 0, 10.2, 12.2), ("R", 1, 12.2, 13.0), ("C", 1, 13.0, 15.0)],
                 1: [("C", 0, 10.0, 14.0), ("R", 1, 14.0, 14.5), ("C", 1, 14.5, 15.0)]}
    view = cl.draw_schedule(timelines, kinds=RING_KINDS, title="ring")
    assert capsys.readouterr().out == "rank 0: P0 C0 R1 C1\nrank 1: C0 R1 C1\n"
    assert view.span_s == pytest.approx(5.0) and view.stats[0].busy_s == pytest.approx(4.9)
    assert view.stats[0].idle_s == pytest.approx(0.1)               # between the post's end and the compute
    legend = [t.get_text() for t in view.fig.axes[0].get_legend().get_texts()]
    assert legend == ["transfer posted", "compute", "wait"]         # in the order `kinds` gives them
    assert view.fig.axes[0].get_xlabel().endswith("white space: none of the kinds drawn")   # not "waits"
    assert overflow_inches(view.fig) == 0.0


def test_draw_schedule_keeps_the_pipeline_kinds_by_default_and_names_bad_kinds_in_one_line():
    view = cl.draw_schedule({0: [("F", 0, 0.0, 1.0), ("B", 0, 1.0, 3.0)]}, quiet=True)
    assert [t.get_text() for t in view.fig.axes[0].get_legend().get_texts()] == ["forward", "backward"]
    for timelines, kinds, says in (({0: [("C", 0, 0.0, 1.0)]}, None, "kind 'C', expected one of"),
                                   ({0: [("F", 0, 0.0, 1.0)]}, RING_KINDS, "kind 'F', expected one of"),
                                   ({0: [("C", 0, 0.0, 1.0)]}, {"C": "#9ecae1"}, r"maps each kind to \(colour"),
                                   ({0: [("C", 0, 0.0, 1.0)]}, {"C": ("tab:blue", "compute")}, '"#rrggbb"')):
        with pytest.raises(ValueError, match=says) as raised:
            cl.draw_schedule(timelines, quiet=True, kinds=kinds)
        assert "\n" not in str(raised.value)


def _tiles_by_positions(rank: int, p: int, zigzag: bool, s: int = 96) -> int:
    """Tiles with at least one key at or before one of its queries, over the sequence's real positions."""
    n = s // (2 * p)
    chunks = (rank, 2 * p - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)
    return sum(any(kp <= qp for qp in range(qc * n, (qc + 1) * n) for kp in range(kc * n, (kc + 1) * n))
               for qc in chunks for kc in range(2 * p))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_causal_tiles_count_what_the_mask_leaves_and_zigzag_balances_them(p):
    contiguous = [causal_tiles(r, p, False) for r in range(p)]
    zigzag = [causal_tiles(r, p, True) for r in range(p)]
    assert contiguous == [_tiles_by_positions(r, p, False) for r in range(p)] == [4 * r + 3 for r in range(p)]
    assert zigzag == [_tiles_by_positions(r, p, True) for r in range(p)] == [2 * p + 1] * p
    assert sum(contiguous) == sum(zigzag) == p * (2 * p + 1)       # the same work, shared out differently


def _ledger(*isend_bytes: int, warm_up: int = 0) -> list[dict]:
    calls = [{"op": "barrier"}]
    calls += [{"op": "batch_isend_irecv", "ops": [["isend", 1, warm_up], ["irecv", 3, warm_up]]}] * bool(warm_up)
    calls += [{"op": "barrier"}]
    calls += [{"op": "batch_isend_irecv", "ops": [["isend", 1, n], ["irecv", 3, n]]} for n in isend_bytes]
    return calls + [{"op": "reduce_scatter"}]


def test_the_lessons_predictions_are_registered():
    assert "09" in LESSONS
    assert sorted(p for p in all_predictions() if p.startswith("09.")) == [
        "09.causal_tiles", "09.ring_bytes", "09.scores_per_rank", "09.ulysses_bytes"]


def test_ring_bytes_counts_the_kept_rings_isends_only_and_catches_a_ring_that_sends_k_and_v_apart():
    spec = prediction("09.ring_bytes")
    results = {"ring4": {r: {"shape": [1, 4, 1024, 32]} for r in range(4)}}
    block = 2 * 4 * 256 * 32 * 4
    ledgers = {0: _ledger(block, block, block, warm_up=block)}     # the warm-up ring is before the last barrier
    assert kept_isends(ledgers[0]) == [block] * 3
    assert spec.measure(results, ledgers) == spec.formula(results) == (3, 3 * block)
    apart = {0: _ledger(*[block // 2] * 6)}                          # k and v in two messages a step
    assert spec.measure(results, apart) != spec.formula(results)


def test_scores_per_rank_and_causal_tiles_measure_what_the_ranks_published():
    scores = prediction("09.scores_per_rank")
    results = {"ring4": {r: {"shape": [1, 4, 1024, 32], "scores": 4 * 256 * 1024} for r in range(4)}}
    assert scores.measure(results, {}) == scores.formula(results) == 4 * 256 * 1024
    results["ring4"][0]["scores"] = 4 * 1024 * 1024                  # a rank that computed everything
    assert scores.measure(results, {}) != scores.formula(results)
    tiles = prediction("09.causal_tiles")
    causal = {"causal": {r: {"contiguous": {"tiles": 4 * r + 3}, "zigzag": {"tiles": 9}} for r in range(4)}}
    assert tiles.measure(causal, {}) == tiles.formula(causal) == (3, 15, 9)
    causal["causal"][0]["zigzag"]["tiles"] = 3                       # a "zigzag" run that was contiguous
    assert tiles.measure(causal, {}) != tiles.formula(causal)


def _a2a(*shapes: list[int]) -> list[dict]:
    """A ledger of all_to_all_single calls, float32, as the ledger records them: input shapes and bytes."""
    calls = [{"op": "barrier"}]
    for shape in shapes:
        n = 4
        for d in shape:
            n *= d
        calls.append({"op": "all_to_all_single", "shapes": [shape], "bytes": n})
    return calls


def test_ulysses_bytes_counts_the_forwards_two_all_to_alls_without_the_piece_that_stays():
    spec = prediction("09.ulysses_bytes")
    results = {"ulysses4": {r: {"shape": [1, 4, 512, 32]} for r in range(4)}}
    qkv, out = [4, 3, 1, 1, 128, 32], [4, 1, 1, 1, 128, 32]       # what seq_to_heads / heads_to_seq send
    ledgers = {0: _a2a(qkv, out, out, qkv)}                         # forward 2, then backward 2
    assert sent_to_others(ledgers[0][1]) == 3 * 65536 * 3 // 4
    assert spec.measure(results, ledgers) == spec.formula(results) == 196_608
    assert spec.formula(results) * 2 == 3 * 2 * 4 * 128 * 32 * 4   # half the ring's 3 blocks of k and v at p = 4
    everything = sum(c["bytes"] for c in ledgers[0][1:3])           # the own piece counted as sent
    assert everything != spec.formula(results)
    three = {0: _a2a([4, 1, 1, 1, 128, 32], [4, 1, 1, 1, 128, 32], [4, 1, 1, 1, 128, 32], out)}  # q, k, v apart
    assert spec.measure(results, three) != spec.formula(results)    # only 2 forward calls counted: q, k, v as one


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ulysses_bytes_formula_is_two_over_p_of_the_rings(p):
    spec = prediction("09.ulysses_bytes")
    results = {"ulysses4": {r: {"shape": [1, 8, 1024, 16]} for r in range(p)}}
    ring = prediction("09.ring_bytes").formula({"ring4": {r: {"shape": [1, 8, 1024, 16]} for r in range(p)}})[1]
    assert spec.formula(results) * p == 2 * ring
