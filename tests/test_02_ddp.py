"""Lesson 02's exercises, graded on real gloo ranks: the solution scores full marks, the stub
zero with the exercise's first hint (shown once per report), and each plausible wrong answer loses
exactly the points its mistake deserves, with a message that names what is wrong.

One set of grading ranks serves the whole module (as the grader gives one to a submission): it is
started once, forked from a server that has imported torch and torch._dynamo (which DDP's constructor
imports), and restarted only after a run that failed.
"""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest

import grading_answers_02 as answers
from exercise_checks import (shared_ranks, assert_full_marks, assert_loses_exactly, assert_section_states_the_check,
                             assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import notebook_path, exercise_sections, markdown_cells
from course_lib.grading.cells import EXERCISE_ID, exercise_cells
from course_lib.grading.checker import check_exercise, preload_for, rank_set_for
from course_lib.grading.lessons.lesson02.ddp_from_scratch import CAPS, MICRO_ROWS, ROWS, SHARED, ready_order
from course_lib.grading.lessons.lesson02.exercises import ATOL, FP16_ATOL, FP16_RTOL, LR, RTOL, greedy_buckets
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line
from course_lib.units import binary_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = "02_ddp.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("02")


ranks = shared_ranks(IDS)


def _markdown(notebook: str) -> list[str]:
    return markdown_cells(notebook, NOTEBOOK)


def _sections(notebook: str) -> dict[str, str]:
    return exercise_sections(notebook, NOTEBOOK)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["02.bucketed_allreduce", "02.no_sync_accumulation", "02.fp16_compress_hook",
                   "02.ddp_from_scratch"]
    cells = exercise_cells(nbformat.read(notebook_path(notebook, NOTEBOOK), as_version=4))
    assert list(cells) == IDS  # the %%exercise cells, in the registry's order
    markdown = "\n".join(_markdown(notebook))
    assert re.findall(r"^\d+\. `(\S+)`", markdown, re.M) == IDS  # the list under Goal
    assert list(_sections(notebook)) == IDS
    named = set(re.findall(rf"\b{EXERCISE_ID.pattern}\b", markdown))
    assert named <= set(IDS), f"the text names exercises nobody grades: {sorted(named - set(IDS))}"


def _case_phrases(exercise_id: str, case: dict) -> list[str]:
    """What the text must say about one case (rank 0's arguments and the world size)."""
    n, args = len(case), case[0]
    if exercise_id == "02.fp16_compress_hook":
        rows = args[1].shape[0]
        return [f"a batch of {rows * n} rows, {rows} per rank"]
    if exercise_id == "02.ddp_from_scratch":
        cap = args[1]
        shape = (SHARED["layers"], tuple(args[5]), tuple(map(tuple, args[6]))) if len(args) > 5 else ()
        buckets = greedy_buckets([nbytes for _, nbytes in ready_order(*shape)], cap)
        return [f"a cap of {binary_bytes(cap)} (buckets of {', '.join(binary_bytes(b) for b in buckets)})",
                f"{args[2][0][0].shape[0]} rows per rank", f"micro-batches of {args[3][0][0].shape[0]} rows"]
    if exercise_id == "02.bucketed_allreduce":
        tensors, cap = args
        shapes = ", ".join("x".join(map(str, t.shape)) for t in tensors)
        buckets = greedy_buckets([t.numel() * t.element_size() for t in tensors], cap)
        return [f"{str(tensors[0].dtype)[6:]} tensors of shapes {shapes} with a cap of {binary_bytes(cap)}",
                "buckets of " + ", ".join(binary_bytes(b) for b in buckets)]
    micro_batches = args[1]
    return [f"K={len(micro_batches)} micro-batches of {micro_batches[0][0].shape[0]} rows per rank"]


def _power(tolerance: float) -> str:
    """A tolerance as the text writes it: 1e-05 -> "1e-5"."""
    return f"{tolerance:.0e}".replace("e-0", "e-")


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    """What the checks enforce (lesson02.py, rank_runner's blocked calls), as the learner reads it."""
    text = _sections("solutions")[exercise_id]
    assert_section_states_the_check(exercise_id, text, _case_phrases)
    if exercise_id == "02.fp16_compress_hook":
        assert f"atol {_power(FP16_ATOL)} + rtol {_power(FP16_RTOL)}" in text
    else:
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text
    if exercise_id in ("02.no_sync_accumulation", "02.ddp_from_scratch"):
        assert f"lr {LR:g}" in text
    assert exercise(exercise_id).allowed_ops is not None


def test_the_ddp_exercises_fork_their_ranks_with_torch_dynamo_imported():
    """DDP's constructor imports torch._dynamo (seconds): the ranks' server imports it before forking."""
    assert preload_for([exercise("02.bucketed_allreduce"), exercise("02.ddp_from_scratch")]) == ()  # no DDP
    assert preload_for([exercise(i) for i in IDS]) == ("torch._dynamo",)
    found = exercise("02.no_sync_accumulation")
    # The cell itself runs on the ranks before the checker's DDP exists: torch._dynamo is there already.
    cell = answers.ACCUMULATION_SOLUTION.replace(
        "import torch\n", "import sys\nimport torch\n\nassert 'torch._dynamo' in sys.modules, 'not preloaded'\n", 1)
    with rank_set_for([found]) as own:
        items = check_exercise(found, cell, ranks=own)
    assert all(item.passed for item in items), "\n".join(map(item_line, items))


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_points_to_the_lesson_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


BUCKET_VALUES_2, BUCKET_CALLS_2, BUCKET_VALUES_3, BUCKET_CALLS_3 = (
    "averages every tensor in place on 2 ranks (float32 and float64)",
    "one all_reduce per bucket, of the bucket's bytes, on 2 ranks",
    "averages on 3 ranks, with a tensor larger than the cap",
    "one all_reduce per bucket on 3 ranks (the large tensor alone)")
STEP_2, SYNC_ONCE, ZERO_GRAD, STEP_3 = (
    "one step equals one process on the whole batch (2 ranks, K=2 and K=3)",
    "DDP all-reduces once per bucket per step (K-1 backwards inside no_sync)",
    "leaves no gradient behind (zero_grad after the step)",
    "one step equals one process on the whole batch (3 ranks, K=2)")
HOOK_GRADS_2, HOOK_WIRE_2, HOOK_ASYNC, HOOK_GRADS_3, HOOK_WIRE_3 = (
    "gradients equal the full-batch ones within float16 rounding (2 ranks)",
    "all-reduces float16: half the bytes of the float32 gradients (2 ranks)",
    "starts the all_reduce with async_op=True and returns its future",
    "gradients equal the full-batch ones within float16 rounding (3 ranks)",
    "all-reduces float16: half the bytes of the float32 gradients (3 ranks)")
OWN_HOOK = "your hook uses torch's own fp16_compress_hook; write the compression yourself"
DDP_GRADS, DDP_PARITY_2, DDP_BUCKETS_2, DDP_OVERLAP, DDP_NO_SYNC, DDP_RANK0_2, DDP_PARITY_3, DDP_BUCKETS_3, DDP_RANK0_3 = (
    "every .grad is the full-batch average after finish_gradient_synchronization() (2 ranks)",
    "3 SGD steps equal one process, from equal and from different parameters (2 ranks)",
    f"one all_reduce per bucket of at most {CAPS[2]} B, in the order gradients become ready (2 ranks)",
    "the all_reduces start asynchronously while backward runs, and nothing waits before it returns (overlap)",
    "no_sync(): nothing sent inside it; the next synchronised step equals one process",
    "the constructor gives every rank rank 0's parameters (2 ranks)",
    "3 SGD steps equal one process, from equal and from different parameters (3 ranks)",
    f"one all_reduce per bucket of at most {CAPS[3]} B (3 ranks)",
    "the constructor gives every rank rank 0's parameters (3 ranks)")
SHARED_GRADS, SHARED_PARITY, SHARED_BUCKETS = (
    "a frozen parameter keeps .grad None, a tied weight's gradient is averaged once, the others equal one "
    "process (2 ranks)",
    "3 SGD steps of the module with a frozen and a tied parameter equal one process (2 ranks)",
    "one all_reduce per bucket of at most 128 B of the gradients that exist: none for the frozen parameter, the "
    "tied one once (2 ranks)")
SHARED_RAISED = ("rank 0 raised at cell line", "RuntimeError: cannot register a hook on a tensor that doesn't "
                 "require gradient (in this case the module's 0.weight is frozen (requires_grad=False: no hook, its "
                 ".grad stays None)")

WRONG = [
    pytest.param("02.bucketed_allreduce", answers.BUCKETED_PER_TENSOR, {
        BUCKET_CALLS_2: "5 all_reduce calls of 48 B, 20 B, 16 B, 28 B, 24 B, expected 3, of 48 B, 64 B, 24 B "
                        "(consecutive tensors, in order, in buckets of at most 64 B): one all_reduce per tensor",
        BUCKET_CALLS_3: "6 all_reduce calls of 8 B, 160 B, 12 B, 20 B, 4 B, 4 B, expected 4, of 8 B, 160 B, 32 B, "
                        "8 B (consecutive tensors, in order, in buckets of at most 32 B): one all_reduce per tensor",
    }, id="bucketed-per-tensor"),
    pytest.param("02.bucketed_allreduce", answers.BUCKETED_NO_COPY_BACK, {
        BUCKET_VALUES_2: "tensor 0 element [0, 0] is 6, expected 1.5: it is unchanged; copy the averaged flat "
                         "bucket back into the tensors",
        BUCKET_VALUES_3: "it is unchanged; copy the averaged flat bucket back",
    }, id="bucketed-no-copy-back"),
    pytest.param("02.bucketed_allreduce", answers.BUCKETED_REPLACES_ENTRIES, {
        BUCKET_VALUES_2: "tensor 0 element [0, 0] is 6, expected 1.5: it is unchanged",
        BUCKET_VALUES_3: "it is unchanged; copy the averaged flat bucket back",
    }, id="bucketed-replaces-entries"),
    pytest.param("02.bucketed_allreduce", answers.BUCKETED_SUMS, {
        BUCKET_VALUES_2: "that is 2 times the average",
        BUCKET_VALUES_3: "that is 3 times the average",
    }, id="bucketed-sums"),
    pytest.param("02.bucketed_allreduce", answers.BUCKETED_STRICT_CAP, {
        BUCKET_CALLS_2: "3 all_reduce calls of 48 B, 36 B, 52 B, expected 3, of 48 B, 64 B, 24 B (consecutive "
                        "tensors, in order, in buckets of at most 64 B): a bucket of exactly 64 B was split",
        BUCKET_CALLS_3: "4 all_reduce calls of 8 B, 160 B, 12 B, 28 B, expected 4, of 8 B, 160 B, 32 B, 8 B "
                        "(consecutive tensors, in order, in buckets of at most 32 B): a bucket of exactly 32 B was "
                        "split",
    }, id="bucketed-strict-cap"),
    pytest.param("02.no_sync_accumulation", answers.ACCUMULATION_SYNC_EVERY_TIME, {
        SYNC_ONCE: "2 all_reduce calls of 176 B, 176 B, expected 1 (one per DDP bucket, on the last backward "
                   "only): DDP synchronised 2 times; the first K-1=1 micro-batches' forward and backward both belong "
                   "inside ddp_model.no_sync()",
    }, id="accumulation-syncs-every-time"),
    pytest.param("02.no_sync_accumulation", answers.ACCUMULATION_NEVER_SYNCS, {
        STEP_2: "the ranks hold different parameters, so no gradient was all-reduced; run the last "
                "micro-batch's backward outside no_sync()",
        SYNC_ONCE: "no all_reduce, expected 1 (one per DDP bucket, on the last backward only): DDP never "
                   "synchronised",
        STEP_3: "the ranks hold different parameters",
    }, id="accumulation-never-syncs"),
    pytest.param("02.no_sync_accumulation", answers.ACCUMULATION_NO_DIVIDE, {
        STEP_2: "the update is 2 times too large; divide each micro-batch's loss by K=2",
        STEP_3: "the update is 2 times too large",
    }, id="accumulation-no-divide"),
    pytest.param("02.no_sync_accumulation", answers.ACCUMULATION_NO_ZERO_GRAD, {
        ZERO_GRAD: "0.weight.grad is not zero after the step; call optimizer.zero_grad() after optimizer.step()",
    }, id="accumulation-no-zero-grad"),
    pytest.param("02.fp16_compress_hook", answers.FP16_NO_DIVIDE, {
        HOOK_GRADS_2: "that is 2 times the average, the sum",
        HOOK_GRADS_3: "that is 3 times the average, the sum",
    }, id="fp16-no-divide"),
    pytest.param("02.fp16_compress_hook", answers.FP16_SUM_THEN_DIVIDE, {
        HOOK_GRADS_2: "float16 overflowed (its largest value is 65504): each rank's gradient fits",
    }, id="fp16-sum-then-divide"),
    pytest.param("02.fp16_compress_hook", answers.FP16_NO_COMPRESSION, {
        HOOK_WIRE_2: "all_reduce float32 of 176 B, expected 1 call: float16 of 88 B (half the float32 gradients' "
                     "bytes): float32 on the wire, twice the bytes",
        HOOK_WIRE_3: "all_reduce float32 of 176 B, expected 1 call: float16 of 88 B",
    }, id="fp16-no-compression"),
    pytest.param("02.fp16_compress_hook", answers.FP16_BLOCKING, {
        HOOK_ASYNC: "the all_reduce was not asynchronous, so backward waited for it",
    }, id="fp16-blocking"),
    pytest.param("02.fp16_compress_hook", answers.FP16_TORCH_HOOK, {
        name: OWN_HOOK for name in (HOOK_GRADS_2, HOOK_WIRE_2, HOOK_ASYNC, HOOK_GRADS_3, HOOK_WIRE_3)
    }, id="fp16-torch-hook"),
    pytest.param("02.fp16_compress_hook", answers.FP16_TORCH_HOOK_BY_MODULE, {
        name: OWN_HOOK for name in (HOOK_GRADS_2, HOOK_WIRE_2, HOOK_ASYNC, HOOK_GRADS_3, HOOK_WIRE_3)
    }, id="fp16-torch-hook-by-module"),
    # DDP copies the hook's result into each float32 .grad, casting it: not casting back is no mistake.
    pytest.param("02.fp16_compress_hook", answers.FP16_NO_CAST_BACK, {}, id="fp16-no-cast-back-passes"),
    pytest.param("02.ddp_from_scratch", answers.DDP_WAITS_IN_HOOK, {
        DDP_OVERLAP: "rank 0, step 1: waited for a collective 5 times while backward ran (inside a hook): backward "
                     "stalled on each bucket's all-reduce, no overlap",
    }, id="ddp-waits-in-the-hook"),
    pytest.param("02.ddp_from_scratch", answers.DDP_NO_SYNC_DROPS, {
        DDP_NO_SYNC: "that is the average of the micro-batch run outside no_sync() only: the gradient computed "
                     "inside it was lost",
    }, id="ddp-no-sync-drops-the-gradient"),
    pytest.param("02.ddp_from_scratch", answers.DDP_ALL_IN_FINISH, {
        DDP_OVERLAP: "rank 0, step 1: 0 of 5 all_reduce calls started before backward returned, none before the "
                     "last gradient was ready",
    }, id="ddp-all-reduces-after-backward"),
    pytest.param("02.ddp_from_scratch", answers.DDP_NO_BROADCAST, {
        DDP_PARITY_2: "did not start from rank 0's parameters, so the averaged gradients mix different models",
        DDP_RANK0_2: "rank 1, the ranks start from different parameters: 0.weight right after the constructor "
                     "element [0, 0] is 0.302861, expected -0.0422285 (rank 0's): it is this rank's own: the ranks "
                     "start different and stay different",
        DDP_PARITY_3: "ranks 1, 2 did not start from rank 0's parameters",
        DDP_RANK0_3: "it is this rank's own: the ranks start different and stay different",
    }, id="ddp-no-initial-broadcast"),
    pytest.param("02.ddp_from_scratch", answers.DDP_AVERAGES_TWICE, {
        DDP_GRADS: "rank 0, step 1: 0.weight.grad after finish_gradient_synchronization() element [0, 0] is "
                   "0.00855535, expected 0.0171107: that is the average divided by 2 again: the gradients were "
                   "averaged twice",
        DDP_PARITY_2: "the ranks start from the same parameters: 0.weight after step 1",
        DDP_NO_SYNC: "0.weight's gradient element [0, 0] is -0.00810284, expected -0.0159232",
        DDP_PARITY_3: "the ranks start from the same parameters: 0.weight after step 1",
        SHARED_GRADS: "rank 0, the module with 0.weight frozen and 4.weight tied to 2.weight, step 1: 0.bias.grad after "
                      "finish_gradient_synchronization() element 0 is 0.000660984, expected 0.00132197: that is the "
                      "average divided by 2 again",
        SHARED_PARITY: "the module with 0.weight frozen and 4.weight tied to 2.weight: 0.bias after step 1",
    }, id="ddp-averages-twice"),
    # DDP's own order: divide while copying into the bucket, not after the all-reduce. Right.
    pytest.param("02.ddp_from_scratch", answers.DDP_PRE_DIVIDES, {}, id="ddp-divides-before-passes"),
    pytest.param("02.ddp_from_scratch", answers.DDP_LAST_BUCKET_NOT_COPIED_BACK, {
        DDP_GRADS: "0.weight.grad after finish_gradient_synchronization() element [0, 0] is 0.0342214, expected "
                   "0.0171107: that is this rank's own gradient, not averaged (while 0.bias was averaged): a "
                   "bucket's average never reached its gradients",
        DDP_PARITY_2: "0.weight after step 1",
        DDP_NO_SYNC: "0.weight's gradient",
        DDP_PARITY_3: "0.weight after step 1",
        SHARED_GRADS: "0.bias.grad after finish_gradient_synchronization() element 0 is 0.00185297, expected 0.00132197",
        SHARED_PARITY: "0.bias after step 1",
    }, id="ddp-last-bucket-not-copied-back"),
    pytest.param("02.ddp_from_scratch", answers.DDP_REACHES_THE_CAP, {
        DDP_BUCKETS_2: "3 all_reduce calls of 104 B, 256 B, 160 B, expected 5, of 72 B, 32 B, 256 B, 32 B, 128 B "
                       "(buckets of at most 96 B, in the order the gradients become ready): buckets that pass 96 B "
                       "(DDP's rule",
        DDP_BUCKETS_3: "2 all_reduce calls of 360 B, 160 B, expected 3, of 104 B, 288 B, 128 B (buckets of at most "
                       "300 B, in the order the gradients become ready): buckets that pass 300 B (DDP's rule",
        SHARED_BUCKETS: "3 all_reduce calls of 136 B, 256 B, 32 B, expected 4, of 104 B, 32 B, 256 B, 32 B (buckets of "
                        "at most 128 B): buckets that pass 128 B (DDP's rule",
    }, id="ddp-buckets-reach-the-cap"),
    pytest.param("02.ddp_from_scratch", answers.DDP_HOOKS_ON_FROZEN, {
        name: SHARED_RAISED for name in (SHARED_GRADS, SHARED_PARITY, SHARED_BUCKETS)
    }, id="ddp-hooks-on-a-frozen-parameter"),
    # The last bucket stays open; the next step's first gradient finds its parameters' .grad set to None by
    # zero_grad(): the run raises, and the line names the frozen parameter.
    pytest.param("02.ddp_from_scratch", answers.DDP_COUNTS_FROZEN, {
        name: ("rank 0 raised at cell line", "AttributeError: 'NoneType' object has no attribute 'reshape' (in this "
               "case the module's 0.weight is frozen (requires_grad=False: no hook, its .grad stays None)")
        for name in (SHARED_GRADS, SHARED_PARITY, SHARED_BUCKETS)
    }, id="ddp-counts-the-frozen-parameter"),
    pytest.param("02.ddp_from_scratch", answers.DDP_TIED_TWICE, {
        SHARED_BUCKETS: "step 1: 5 all_reduce calls of 104 B, 32 B, 256 B, 256 B, 32 B, expected 4, of 104 B, 32 B, "
                        "256 B, 32 B (buckets of at most 128 B): 2.weight was all-reduced twice; it is one Parameter "
                        "used by two layers, listed once by module.parameters()",
    }, id="ddp-all-reduces-a-tied-weight-twice"),
    pytest.param("02.ddp_from_scratch", answers.DDP_PARAMETER_ORDER, {
        DDP_BUCKETS_2: "5 all_reduce calls of 8 B, 96 B, 256 B, 32 B, 128 B, expected 5, of 72 B, 32 B, 256 B, 32 B, "
                       "128 B (buckets of at most 96 B, in the order the gradients become ready): buckets made of "
                       "consecutive parameters in the order of module.parameters()",
        DDP_BUCKETS_3: "3 all_reduce calls of 72 B, 288 B, 160 B, expected 3, of 104 B, 288 B, 128 B (buckets of at "
                       "most 300 B, in the order the gradients become ready): buckets made of consecutive parameters "
                       "in the order of module.parameters()",
        SHARED_BUCKETS: "4 all_reduce calls of 8 B, 128 B, 256 B, 32 B, expected 4, of 104 B, 32 B, 256 B, 32 B "
                        "(buckets of at most 128 B): buckets made of consecutive parameters in the order of "
                        "module.parameters()",
    }, id="ddp-buckets-in-parameter-order"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    assert_loses_exactly(exercise_id, source, lost, ranks=ranks)


def test_greedy_buckets_fill_up_to_the_cap_and_give_a_large_tensor_its_own():
    assert greedy_buckets([48, 20, 16, 28, 24], 64) == [48, 64, 24]  # 20 + 16 + 28 = 64: the cap, allowed
    assert greedy_buckets([8, 160, 12, 20, 4, 4], 32) == [8, 160, 32, 8]  # 160 > 32: alone
    assert greedy_buckets([], 64) == []


def test_gradients_become_ready_last_layer_first_in_the_ddp_exercise():
    """The order the statement's bucket sizes come from (and lesson 02's hook cell shows on its own model)."""
    assert [name for name, _ in ready_order()] == ["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]
    ready = [b for _, b in ready_order()]
    assert [greedy_buckets(ready, CAPS[n]) for n in (2, 3)] == [[72, 32, 256, 32, 128], [104, 288, 128]]
    # At each cap, buckets made in module.parameters() order and started as each completes send other sizes.
    assert all(greedy_buckets(ready, CAPS[n]) != greedy_buckets(ready[::-1], CAPS[n])[::-1] for n in (2, 3))
    assert (ROWS, MICRO_ROWS) == (4, 2)


def test_memory_table_names_ddp_buckets_and_the_bucket_view():
    """Shared code lesson 02 changed, additively: predict_step(gradient_as_bucket_view=True) counts the buckets
    once the gradients live in them; show_memory names the "buffers" column "ddp buckets" when only DDP is
    shown (it stays "buffers" beside FSDP) and a bucket-view result "ddp+view". (The lesson's memory cell
    asserts the measured side: 396,288 B less after the step.)"""
    import torch

    from course_lib.draw.memory import show_memory
    from course_lib.measure.memory import PHASES, named_shapes, predict_step

    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    shapes, buckets = named_shapes(model), 4 * 99_072
    plain = predict_step(shapes, strategy="ddp", world_size=2, rank=0)
    view = predict_step(shapes, strategy="ddp", world_size=2, rank=0, gradient_as_bucket_view=True)
    assert [plain["phases"][p]["buffers"] for p in PHASES] == [buckets] * 4
    assert [view["phases"][p]["buffers"] for p in PHASES] == [buckets, buckets, 0, 0]
    assert view["phases"]["step"]["gradients"] == plain["phases"]["step"]["gradients"] == buckets
    shown = show_memory([{**plain, "peak": {}}, {**view, "peak": {}}], model=model, display=False)
    assert not shown.mismatches() and {row.strategy for row in shown.rows} == {"ddp", "ddp+view"}
    header = shown.table.splitlines()[0]
    assert "ddp buckets" in header and "buffers" not in header
    assert "+view: DDP with gradient_as_bucket_view=True" in shown.table
    fsdp = predict_step(shapes, strategy="fsdp2", world_size=2, rank=0)
    mixed = show_memory([{**plain, "peak": {}}, {**fsdp, "peak": {}}], model=model, display=False)
    assert "buffers" in mixed.table.splitlines()[0] and "ddp buckets" not in mixed.table
