"""course_lib.measure.comm / comm_draw: the collective ledger as bytes per op per step, against theory and CommDebugMode.

Fast tests use a hand-built ledger. The multi-rank tests launch ONE torchrun
script per world size (2 and 4 ranks, gloo) that trains the toy model two
steps under DDP (with the stock allreduce_hook, so the ledger sees the
gradient all-reduce) and two steps under FSDP2, then counts one step of each
under CommDebugMode. Every step is preceded by `dist.barrier()`: that is how
`comm_table` cuts the ledger into steps.
"""

import collections
import gc
import warnings

import pytest

from course_lib import theory
from course_lib.measure.comm import comm_table, compare_with_theory, split_steps
from course_lib.vocabulary import canonical_op
from course_lib.draw.comm import show_comm, show_timeline
from course_lib.draw.figures import png_bytes
from course_lib.models import toy_model
from course_lib.launcher.torchrun import run_torchrun


def _entry(seq, op, nbytes=0, start=0.0, end=None, is_async=False, group="world"):
    return {"seq": seq, "op": op, "group": group, "shapes": [], "dtype": "float32", "bytes": nbytes,
            "start": start, "end": start + 0.001 if end is None else end, "async": is_async, "error": None}


# Two steps of [all_gather, all_gather, reduce_scatter] with barriers before each step.
HAND = {
    r: [_entry(1, "broadcast", 40, 0.0 + r)]
    + [e for k in range(2) for e in (
        _entry(2 + 4 * k, "barrier", 0, 1.0 + k + r),
        _entry(3 + 4 * k, "all_gather_into_tensor", 100, 1.1 + k + r),
        _entry(4 + 4 * k, "all_gather_single", 100, 1.2 + k + r),
        _entry(5 + 4 * k, "reduce_scatter_single", 200 + k, 1.3 + k + r, is_async=True),
    )]
    for r in (0, 1)
}


def test_split_steps_by_barrier_and_by_count():
    steps = split_steps(HAND[0])
    assert [[e["op"] for e in s] for s in steps] == [
        ["broadcast"],
        ["all_gather_into_tensor", "all_gather_single", "reduce_scatter_single"],
        ["all_gather_into_tensor", "all_gather_single", "reduce_scatter_single"],
    ]
    by_count = split_steps(HAND[0][1:], steps=2)  # without the set-up broadcast: 6 calls, 2 steps
    assert by_count[0] == [] and [len(s) for s in by_count[1:]] == [3, 3]
    with pytest.raises(ValueError):
        split_steps(HAND[0], steps=2)  # 7 calls do not split evenly
    # A barrier on a subgroup does not cut a step, and is not a call of it either.
    sub = [_entry(1, "barrier", group="ranks 0,1"), _entry(2, "all_reduce", 8)]
    assert split_steps(sub) == [sub[1:]]


def test_table_groups_bytes_per_op_with_canonical_names():
    table = comm_table(HAND)
    assert table.ranks == [0, 1] and table.num_steps == 3
    assert table.by_op(0, 1) == {"all_gather_single": 200, "reduce_scatter_single": 200}
    assert table.by_op(1, 2) == {"all_gather_single": 200, "reduce_scatter_single": 201}
    assert table.counts(0, 1) == {"all_gather_single": 2, "reduce_scatter_single": 1}
    assert table.sequence(0, 0) == [("broadcast", 40)] and table.total(0, 2) == 401
    assert table.step_calls(0, 1)[0]["ledger_op"] == "all_gather_into_tensor"
    assert table.by_op(0, 9) == {} and table.sequence(7, 1) == []
    rows = [(r.rank, r.step, r.op, r.count, r.bytes) for r in table.rows() if r.rank == 0]
    assert rows == [(0, 0, "broadcast", 1, 40), (0, 1, "all_gather_single", 2, 200),
                    (0, 1, "reduce_scatter_single", 1, 200), (0, 2, "all_gather_single", 2, 200),
                    (0, 2, "reduce_scatter_single", 1, 201)]
    assert "reduce_scatter_single" in table.format(rank=0).splitlines()[3]


def test_compare_with_theory_dict_and_list():
    table = comm_table(HAND)
    listed = [("all_gather_into_tensor", 100), ("all_gather_single", 100), ("reduce_scatter_single", 200)]
    rows = compare_with_theory(table, listed, ranks=[0])
    assert [(r.step, r.op, r.measured_bytes, r.predicted_bytes, r.measured_count, r.predicted_count, r.match)
            for r in rows] == [(1, "all_gather_single", 200, 200, 2, 2, True),
                               (1, "reduce_scatter_single", 200, 200, 1, 1, True),
                               (2, "all_gather_single", 200, 200, 2, 2, True),
                               (2, "reduce_scatter_single", 201, 200, 1, 1, False)]
    # Same total, different sizes: a list says no, a dict of totals says yes.
    split = [("all_gather_single", 150), ("all_gather_single", 50), ("reduce_scatter_single", 200)]
    assert not compare_with_theory(table, split, ranks=[0], steps=[1])[0].match
    totals = compare_with_theory(table, {"all_gather_single": 200, "all_reduce": 0}, ranks=[0], steps=[1])
    assert [(r.op, r.match, r.predicted_count) for r in totals] == [
        ("all_gather_single", True, None), ("reduce_scatter_single", False, None), ("all_reduce", True, None)]


def _render(view):
    with warnings.catch_warnings():
        gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
        warnings.simplefilter("error")
        return png_bytes(view.fig)


def test_timeline_data_and_render_from_a_hand_built_ledger():
    with warnings.catch_warnings():
        gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
        warnings.simplefilter("error")
        view = show_timeline(HAND, quiet=True)
    assert _render(view).startswith(b"\x89PNG")
    assert view.origin == {0: 0.0, 1: 0.0}  # one clock: the earliest call anywhere is 0
    assert len(view.bars) == 18 and view.bars[0] == view.bars[0].__class__(0, 1, "broadcast", "world", 40, 0.0,
                                                                           0.001, False)
    assert [b.is_async for b in view.bars if b.op == "reduce_scatter_single"] == [True] * 4
    assert view.lines[0] == "rank 0: 7 calls, 841 B"
    first = show_timeline(HAND, align="first", quiet=True)
    assert first.origin == {0: 0.0, 1: 1.0} and (first.bars[9].rank, first.bars[9].start) == (1, 0.0)
    barrier = show_timeline(HAND, align="barrier", quiet=True)
    assert barrier.origin == {0: 1.001, 1: 2.001}
    assert abs(barrier.bars[2].start - 0.099) < 1e-9  # the first all_gather, 0.099 s after the barrier ended
    step2 = show_timeline(HAND, steps=[2], align="barrier", quiet=True)  # the step and the barrier opening it
    assert [(b.rank, b.op, b.bytes) for b in step2.bars if b.rank == 0] == [
        (0, "barrier", 0), (0, "all_gather_single", 100), (0, "all_gather_single", 100), (0, "reduce_scatter_single", 201)]
    assert step2.origin == {0: 2.001, 1: 3.001} and _render(step2)
    view = show_timeline({0: HAND[0] + [{**_entry(99, "all_reduce", 8, 4.0), "end": None}]}, quiet=True)
    assert view.bars[-1].end is None and _render(view)


def test_timeline_byte_labels_are_horizontal_readable_and_never_lost():
    view = show_timeline(HAND, quiet=True)
    ax = view.fig.axes[0]
    calls = [b for b in view.bars if b.op != "barrier"]
    assert set(view.label_places) == {(b.rank, b.seq) for b in calls}
    left_out = [b for b in calls if view.label_places[(b.rank, b.seq)] == "left out"]
    assert left_out and len(ax.texts) == len(calls) - len(left_out)  # 1 ms calls on a 3 s axis: some too short
    assert all(t.get_rotation() == 0 and t.get_fontsize() >= 9 for t in ax.texts)  # were 6 pt at 60 degrees
    # A label left out of the figure is in the printed summary, under its rank.
    for bar in left_out:
        rank_line = view.lines.index(next(line for line in view.lines if line.startswith(f"rank {bar.rank}:")))
        assert f"#{bar.seq} {bar.op} " in view.lines[rank_line + 1]
    # The labels drawn overlap nothing else drawn and stay inside the axes.
    renderer = view.fig.canvas.get_renderer()
    view.fig.draw_without_rendering()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    inside = ax.get_window_extent(renderer)
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 for b in boxes)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    # A long call carries its label inside the bar.
    long = show_timeline({r: [_entry(1, "all_reduce", 4 << 20, 0.0, 0.03)] for r in range(2)}, quiet=True)
    assert set(long.label_places.values()) == {"inside"}
    assert [t.get_text() for t in long.fig.axes[0].texts] == ["4 MiB", "4 MiB"]
    assert len(long.lines) == 2  # nothing left out: no extra line


def test_timeline_shades_a_lane_from_a_time_and_counts_the_calls_after_it():
    """Lesson 03: each rank's lane shaded from when it ran out of data; its printed line counts the shadows."""
    view = show_timeline(HAND, shade={0: (1.15, "out of data"), 7: (0.0, "no such rank")}, labels=False, quiet=True)
    assert view.lines == ["rank 0: 7 calls, 841 B; 5 after 'out of data'",  # the calls at 1.2, 1.3, 2.1, 2.2, 2.3
                          "rank 1: 7 calls, 841 B"]  # not shaded: the line as without `shade`
    ax = view.fig.axes[0]
    shaded = [p for p in ax.patches if p.get_zorder() == 0]
    assert len(shaded) == 1 and abs(shaded[0].get_x() - 1150.0) < 1e-6  # ms from the origin, to the axis' end
    assert abs(shaded[0].get_x() + shaded[0].get_width() - 3301.0) < 1e-6
    assert [t.get_text() for t in ax.texts if "out of data" in t.get_text()] == [" out of data"]
    late = show_timeline(HAND, shade={1: (3.29, "a label too long to fit after this point")}, labels=False, quiet=True)
    late.fig.draw_without_rendering()
    (text,) = late.fig.axes[0].texts
    assert text.get_window_extent().x1 <= late.fig.axes[0].get_window_extent().x1 + 0.5  # ends at the axis' end
    assert _render(view).startswith(b"\x89PNG")
    assert show_timeline(HAND, quiet=True).lines == show_timeline(HAND, shade={}, quiet=True).lines
    labelled = show_timeline(HAND, shade={1: (2.0, "later")}, quiet=True)  # with byte labels too
    assert labelled.lines[0] == "rank 0: 7 calls, 841 B" and _render(labelled)


def test_show_comm_axis_counts_in_a_unit_without_exponent():
    big = {r: [_entry(1, "barrier", 0, 0.0), _entry(2, "all_reduce", 45 << 20, 0.1)] for r in range(2)}
    view = show_comm(comm_table(big), [("all_reduce", 45 << 20)], quiet=True)
    ax = view.fig.axes[0]
    view.fig.draw_without_rendering()
    assert ax.get_ylabel() == "input MiB per step" and ax.yaxis.get_offset_text().get_text() == ""  # was "1e7"
    assert max(bar.get_height() for bar in ax.patches) == 45


def test_show_comm_data_and_render():
    with warnings.catch_warnings():
        gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
        warnings.simplefilter("error")
        view = show_comm(comm_table(HAND), [("all_gather_single", 100)] * 2 + [("reduce_scatter_single", 200)],
                         quiet=True)
    assert [r.match for r in view.rows] == [True, True, True, False] and not view.match
    assert view.lines[-1].endswith("MISMATCH") and _render(view).startswith(b"\x89PNG")


# ---------------------------------------------------------------- real DDP and FSDP2 runs

SCRIPT = """
import torch, torch.distributed as dist
import course_lib as cl
from course_lib.measure.comm import comm_counts
from course_lib.models import toy_batch, toy_model
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

info = cl.init(timeout_s=60)
x, y = toy_batch(seed=1 + info.rank)

def train_step(model, opt):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()

def ddp(hook):
    model = DDP(toy_model())
    if hook:  # the same all-reduce, issued from Python, where the ledger sees it
        model.register_comm_hook(None, allreduce_hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

def fsdp2():
    model, mesh = toy_model(), init_device_mesh("cpu", (info.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

# Steps 1-2: DDP with allreduce_hook; 3-4: FSDP2; 5: FSDP2 under CommDebugMode;
# 6: DDP + hook under CommDebugMode; 7: plain DDP under CommDebugMode.
counts = {}
for name, (model, opt) in [("ddp", ddp(True)), ("fsdp2", fsdp2())]:
    for _ in range(2):
        dist.barrier()
        train_step(model, opt)
    if name == "fsdp2":
        dist.barrier()
        counts["fsdp2"] = comm_counts(lambda: train_step(model, opt), by_phase=True)
dist.barrier()
model, opt = ddp(True)
counts["ddp_hook"] = comm_counts(lambda: train_step(model, opt))
dist.barrier()
model, opt = ddp(False)
counts["ddp"] = comm_counts(lambda: train_step(model, opt))
dist.barrier()
cl.publish("counts", counts)
dist.destroy_process_group()
"""

DDP_STEPS, FSDP2_STEPS = [1, 2], [3, 4]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def run(request):
    result = run_torchrun(SCRIPT, request.param, timeout_s=240)
    assert result.ok, result.agent_output + "\n".join(result.stderr.values())
    return result


def _fsdp2_units(world_size):
    model = toy_model()
    blocks = [[tuple(p.shape) for p in block.parameters()] for block in model.blocks]
    return blocks + [[tuple(p.shape) for p in model.head.parameters()]]


def test_ddp_ledger_bytes_per_step_equal_the_sum_of_gradient_bytes(run):
    table = comm_table(run.ledgers)
    expected = theory.ddp_step_bytes([p.numel() for p in toy_model().parameters()])
    assert expected == {"all_reduce": 503 * 4}
    rows = compare_with_theory(table, expected, steps=DDP_STEPS)
    assert len(rows) == run.nproc * len(DDP_STEPS) and all(r.match for r in rows), rows
    # One bucket (2012 B < DDP's 1 MiB first bucket): one async all_reduce per step, on every rank.
    for rank in table.ranks:
        assert [e["async"] for s in DDP_STEPS for e in table.step_calls(rank, s)] == [True, True]


def test_fsdp2_ledger_calls_per_step_equal_theory_exactly(run):
    table = comm_table(run.ledgers)
    assert any(table.sequence(0, s) for s in FSDP2_STEPS), (
        "no FSDP2 collective in the ledger: torch 2.13's FSDP2 calls all_gather_single/reduce_scatter_single, "
        "which vocabulary.RECORDED_OPS must include")
    expected = theory.fsdp2_step_collectives(_fsdp2_units(run.nproc), run.nproc)
    rows = compare_with_theory(table, expected, steps=FSDP2_STEPS)
    assert rows and all(r.match for r in rows), [r for r in rows if not r.match]
    for rank in table.ranks:
        for step in FSDP2_STEPS:
            assert table.sequence(rank, step) == [(canonical_op(op), b) for op, b in expected], (rank, step)


def test_first_step_equals_later_steps(run):
    table = comm_table(run.ledgers)
    for rank in table.ranks:
        assert table.sequence(rank, DDP_STEPS[0]) == table.sequence(rank, DDP_STEPS[1])
        assert table.sequence(rank, FSDP2_STEPS[0]) == table.sequence(rank, FSDP2_STEPS[1])
        assert table.sequence(rank, 0) == []  # DDP's and FSDP2's set-up issue nothing the ledger sees


def _by_course_name(counts):
    """CommDebugMode's {op: calls} under the ledger's names (`c10d._allgather_base_` -> `all_gather_single`)."""
    out = collections.Counter()
    for name, n in counts.items():
        out[canonical_op(name)] += n
    return dict(out)


def test_ledger_counts_match_comm_debug_mode(run):
    table = comm_table(run.ledgers)
    for rank, counts in run.results["counts"].items():
        fsdp2 = {op: counts["fsdp2"]["forward"].get(op, 0) + counts["fsdp2"]["backward"].get(op, 0)
                 for op in {*counts["fsdp2"]["forward"], *counts["fsdp2"]["backward"]}}
        units = len(_fsdp2_units(run.nproc))
        # forward: every unit all-gathered; backward: the blocks again, then every unit reduce-scattered
        assert _by_course_name(counts["fsdp2"]["forward"]) == {"all_gather_single": units}
        assert table.counts(rank, 5) == _by_course_name(fsdp2)
        assert table.counts(rank, 6) == _by_course_name(counts["ddp_hook"]) == {"all_reduce": 1}
        # DDP's own all-reduce runs in C++: CommDebugMode counts it, the ledger does not.
        assert counts["ddp"] == {"c10d.allreduce_": 1} and table.counts(rank, 7) == {}


def test_timeline_and_table_figures_from_the_run(run):
    with warnings.catch_warnings():
        gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
        warnings.simplefilter("error")
        timeline = show_timeline(run.ledgers, quiet=True)
        one_step = show_timeline(run.ledgers, steps=[FSDP2_STEPS[0]], quiet=True)
        table = comm_table(run.ledgers)
        comm = show_comm(table, theory.fsdp2_step_collectives(_fsdp2_units(run.nproc), run.nproc),
                         steps=FSDP2_STEPS, quiet=True)
        png_bytes(timeline.fig), png_bytes(one_step.fig), png_bytes(comm.fig)
    assert comm.match
    assert {b.rank for b in timeline.bars} == set(range(run.nproc))
    assert all(b.end is not None and b.end >= b.start >= 0 for b in timeline.bars)
    assert sum(b.bytes for b in timeline.bars if b.rank == 0) == sum(table.total(0, s) for s in range(table.num_steps))
    # One step: its barrier, then exactly the calls the table holds for it, on every rank.
    for rank in range(run.nproc):
        bars = [(b.op, b.bytes) for b in one_step.bars if b.rank == rank]
        assert bars == [("barrier", 0)] + table.sequence(rank, FSDP2_STEPS[0])
