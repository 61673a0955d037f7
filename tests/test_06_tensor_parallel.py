"""Lesson 06: the lesson runs every seed name it must, its predictions' formulas hold, and its exercises,
graded on real gloo ranks: the solution scores full marks, the stub zero with its hint (shown once per
report), and each plausible wrong answer loses the points its mistake deserves, with a message that says
what is wrong (the rank, the case, and the mechanism: an all-reduce where SP reduce-scatters, a gradient left a
term, a token or target not masked, a max that is not the whole row's, a backward that sums again).

One set of grading ranks serves the whole module (as the grader gives one to a submission): started once,
forked from a server that has imported tensor parallel and FSDP, restarted only after a run that failed.
"""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest
import torch

import grading_answers_06 as answers
from exercise_checks import (shared_ranks, assert_full_marks, assert_section_states_the_check,
                             assert_stub_scores_zero_with_its_first_hint_once, failed_items)
from exercise_notebooks import exercise_sections, markdown_cells, notebook_path
from course_lib.grading.cells import EXERCISE_ID, exercise_cells
from course_lib.grading.checker import check_exercise
from course_lib.grading.lessons.lesson06.exercises import ATOL, RTOL
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.predictions import prediction

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = "06_tensor_parallel.ipynb"
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("06")
SP, EMBEDDING, CE = IDS
SOLUTION_OF = {SP: "SP_SOLUTION", EMBEDDING: "EMBEDDING_SOLUTION", CE: "CE_SOLUTION"}
SEED_NAMES = ("init_device_mesh", "mesh_dim_names", "get_group", "parallelize_module", "ColwiseParallel",
              "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "loss_parallel",
              "Shard", "Replicate", "Partial", "distribute_tensor", "redistribute")


ranks = shared_ranks(IDS)


def test_every_lesson_06_seed_name_runs_in_a_code_cell():
    """../shared/SEED_COVERAGE.md's lesson-06 names, each called (not only named) in a code cell of the lesson."""
    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    code = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    for name in SEED_NAMES:
        assert re.search(rf"\b{name}\b\s*[(\[=.]", code) or re.search(rf"[.\"]{name}\b", code), name


def test_the_notebook_lists_exactly_the_exercises_graded():
    assert IDS == ["06.sp_mlp", "06.vocab_embedding", "06.vocab_cross_entropy"]
    for folder in ("solutions", "exercises"):
        cells = exercise_cells(nbformat.read(notebook_path(folder, NOTEBOOK), as_version=4))
        assert list(cells) == IDS
        markdown = "\n".join(markdown_cells(folder, NOTEBOOK))
        assert re.findall(r"^\d+\. `(\S+)`", markdown, re.M) == IDS  # the list under Goal
        assert list(exercise_sections(folder, NOTEBOOK)) == IDS
        assert set(re.findall(rf"\b{EXERCISE_ID.pattern}\b", markdown)) <= set(IDS)
        assert "(../notebooks/06_tensor_parallel.ipynb)" in markdown


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    text = exercise_sections("solutions", NOTEBOOK)[exercise_id]
    assert_section_states_the_check(exercise_id, text)
    assert f"rtol {RTOL:.0e} and atol {ATOL:.0e}".replace("e-0", "e-") in text


def test_the_predictions_formulas():
    """The numbers the lesson's text and explanations state, from the formulas alone."""
    redistribute, mlp, memory = (prediction(f"06.{name}") for name in ("redistribute", "tp_mlp_bytes", "memory_2d"))
    assert redistribute.formula({}) == (0, 0, 1, 1, 0)   # 3 columns on 4 ranks: 1, 1, 1 and nothing
    assert mlp.formula({"by_hand": {0: {"x": (4, 8)}, 1: {"x": (4, 8)}}}) == 2 * 4 * 8 * 4
    from course_lib.models import LLAMA_CONFIG as c

    # make_llama()'s parameters from its config (transformers is slow to import): 26,784 of them.
    kv = c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    h, m, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    layer = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (m, h), "up": (m, h), "down": (h, m),
             "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    shapes = {"embed": (v, h), "norm": (h,), "lm_head": (v, h),
              **{f"layers.{i}.{k}": s for i in range(c["num_hidden_layers"]) for k, s in layer.items()}}
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 26_784
    sharded = [n for n in shapes if "norm" not in n]
    published = {"memory": {0: {"mesh": (2, 2), "shapes": shapes, "tp sharded": sharded}}}
    assert memory.formula(published) == 26_944 == 4 * ((26_784 - 160) // 4 + 160 // 2)


@pytest.mark.slow
@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, getattr(answers, SOLUTION_OF[exercise_id]), ranks=ranks)


@pytest.mark.slow
@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_says_what_to_write_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


WRONG = {
    "SP's exit as an all-reduce": (
        SP, "SP_ALL_REDUCE_EXIT",
        {"all-gather then reduce-scatter in forward, mirrored in backward, nothing else (2 ranks)":
         "SP's exit is a reduce-scatter"}, ("output rows equal one process (2 ranks)",)),
    "the all-gather's backward only slices": (
        SP, "SP_GATHER_BACKWARD_SLICES",
        {"gradients of the rows and of each shard equal one process (2 ranks)": "the all-gather's backward "
         "reduce-scatters",
         "all-gather then reduce-scatter in forward, mirrored in backward, nothing else (2 ranks)": "expected exactly the mirror of forward"},
        ("output rows equal one process (2 ranks)",)),
    "down's bias gradient left a term": (
        SP, "SP_BIAS_TERM",
        {"gradients of the rows and of each shard equal one process (4 ranks)":
         "that is the gradient of this rank's rows only"}, ("output rows equal one process (4 ranks)",)),
    "down's bias gradient all-reduced, the lesson's f": (
        SP, "SP_BIAS_ALL_REDUCED",
        {"all-gather then reduce-scatter in forward, mirrored in backward, nothing else (2 ranks)":
         "an all-reduce is one collective too many"},
        ("output rows equal one process (2 ranks)", "gradients of the rows and of each shard equal one process (2 ranks)")),
    "tokens not masked": (
        EMBEDDING, "EMBEDDING_NOT_MASKED",
        {"output equals one process on every rank (2 ranks)": "must give a zero row (mask it)"}, ()),
    "the embedding's backward sums again": (
        EMBEDDING, "EMBEDDING_BACKWARD_SUMS",
        {"each rank's rows of the weight's gradient equal one process (2 ranks)": "2 times too large",
         "one all-reduce of the output's size in forward, none in backward (2 ranks)": "and backward ['all_reduce']"},
        ("output equals one process on every rank (2 ranks)",)),
    "a local max": (
        CE, "CE_LOCAL_MAX",
        {"the loss equals one process on every rank (2 ranks)": "the max, the sum of exponentials and the target's logit "
         "each need the whole row"}, ()),
    "no max": (
        CE, "CE_NO_MAX",
        {"the loss equals one process on every rank (2 ranks)": "not finite: exp of a large logit overflows"}, ()),
    "the target not masked": (
        CE, "CE_NOT_MASKED",
        {"the loss equals one process on every rank (2 ranks)": "the others masked to zero"}, ()),
    "the loss's backward sums again": (
        CE, "CE_BACKWARD_SUMS",
        {"each rank's columns of the logits' gradient equal one process (4 ranks)": "4 times too large",
         "three all-reduces in forward, none in backward, none carrying the whole logits (2 ranks)":
         "and backward ['all_reduce']"},
        ("the loss equals one process on every rank (2 ranks)",)),
    "down's bias added before the reduce-scatter": (
        SP, "SP_BIAS_BEFORE_SCATTER",
        {"output rows equal one process (2 ranks)": "down's bias is in it 2 times",
         "output rows equal one process (4 ranks)": "down's bias is in it 4 times"},
        ("gradients of the rows and of each shard equal one process (2 ranks)",)),
    "the whole table rebuilt by an all-reduce": (
        EMBEDDING, "EMBEDDING_WHOLE_TABLE",
        {"one all-reduce of the output's size in forward, none in backward (2 ranks)":
         "the all-reduce carried 256 B (the whole table's size), expected 192 B",
         "one all-reduce of the output's size in forward, none in backward (4 ranks)":
         "the whole table must never be rebuilt on one rank"},
        ("output equals one process on every rank (2 ranks)",
         "each rank's rows of the weight's gradient equal one process (2 ranks)")),
    "the backward of a sum, not of the mean": (
        CE, "CE_BACKWARD_NOT_MEAN",
        {"each rank's columns of the logits' gradient equal one process (2 ranks)": "6 times too large: the loss "
         "is the mean over the 6 rows"}, ("the loss equals one process on every rank (2 ranks)",)),
    "the ranks' maxes summed": (
        CE, "CE_SUM_MAX",
        {"the loss equals one process on every rank (2 ranks)": "-inf: every exponential underflowed to 0"}, ()),
    "the whole logits all-reduced": (
        CE, "CE_WHOLE_LOGITS",
        {"three all-reduces in forward, none in backward, none carrying the whole logits (2 ranks)":
         "the whole logits must never exist on one rank"},
        ("the loss equals one process on every rank (2 ranks)",
         "each rank's columns of the logits' gradient equal one process (2 ranks)")),
    "the embedding without an autograd.Function": (
        EMBEDDING, "EMBEDDING_NO_FUNCTION",
        {"each rank's rows of the weight's gradient equal one process (2 ranks)":
         "did not come from a backward you wrote: autograd differentiated your code itself",
         "each rank's rows of the weight's gradient equal one process (4 ranks)":
         "one torch.autograd.Function with your own backward"},
        ("output equals one process on every rank (2 ranks)",
         "one all-reduce of the output's size in forward, none in backward (2 ranks)")),
    "the embedding's Function around the all-reduce only": (
        EMBEDDING, "EMBEDDING_FUNCTION_FOR_THE_SUM_ONLY",
        {"each rank's rows of the weight's gradient equal one process (2 ranks)":
         "(EmbeddingBackward0 reaches the weight)"},
        ("output equals one process on every rank (2 ranks)",
         "one all-reduce of the output's size in forward, none in backward (2 ranks)")),
    "the loss without an autograd.Function": (
        CE, "CE_NO_FUNCTION",
        {"each rank's columns of the logits' gradient equal one process (2 ranks)":
         "did not come from a backward you wrote: autograd differentiated your code itself",
         "each rank's columns of the logits' gradient equal one process (4 ranks)":
         "one torch.autograd.Function with your own backward, the logits passed into it"},
        ("the loss equals one process on every rank (2 ranks)",
         "three all-reduces in forward, none in backward, none carrying the whole logits (2 ranks)")),
    "the loss's backward ignores its incoming gradient": (
        CE, "CE_IGNORES_GRAD",
        {"each rank's columns of the logits' gradient equal one process (2 ranks)":
         "the gradient is off by the loss's incoming gradient: multiply by `grad`",
         "each rank's columns of the logits' gradient equal one process (4 ranks)": "1.33 times too large"},
        ("the loss equals one process on every rank (2 ranks)",
         "three all-reduces in forward, none in backward, none carrying the whole logits (2 ranks)")),
    "two quantities in one all-reduce": (
        CE, "CE_TWO_IN_ONE",
        {"three all-reduces in forward, none in backward, none carrying the whole logits (2 ranks)":
         "forward all-reduced [24, 48] B, 2 numbers per row in one call",
         "three all-reduces in forward, none in backward, none carrying the whole logits (4 ranks)":
         "the exercise asks for three separate all-reduces"},
        ("the loss equals one process on every rank (2 ranks)",
         "each rank's columns of the logits' gradient equal one process (2 ranks)")),
}


def test_the_cross_entropy_statement_names_the_loss_scale_the_driver_backprops():
    """A backward that ignores its incoming gradient must show: the driver backprops LOSS_SCALE x the loss, and
    the exercise says so."""
    from course_lib.grading.lessons.lesson06.drivers import LOSS_SCALE

    assert LOSS_SCALE not in (1.0, 1 / 2, 1 / 4, 1 / 6)   # not a factor another hint names (ranks, rows)
    assert f"backward of {LOSS_SCALE:g} × the returned loss" in exercise_sections("solutions", NOTEBOOK)[CE]


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_answer_fails_with_what_is_wrong(mistake, ranks):
    exercise_id, name, expected, kept = WRONG[mistake]
    source = getattr(answers, name)
    assert source != getattr(answers, SOLUTION_OF[exercise_id])   # the mistake was made
    items = check_exercise(exercise(exercise_id), source, ranks=ranks)
    failed = failed_items(items)
    for item, phrase in expected.items():
        assert item in failed, (item, failed)
        assert phrase in failed[item], failed[item]
        assert failed[item].startswith("rank "), failed[item]
    for item in kept:   # what the mistake leaves right keeps its point
        assert item not in failed, (item, failed[item])
    assert sum(item.score for item in items) < exercise(exercise_id).points


def test_a_gradient_that_never_arrived_is_named_as_such():
    """first_difference on None (a parameter whose .grad stayed None) says so, instead of naming its type."""
    from course_lib.grading.compare import first_difference

    assert first_difference(None, torch.zeros(3), what="down_bias on rank 1") == \
        "is None: no gradient reached down_bias on rank 1"


def test_the_lessons_dispatch_mode_records_dtensors_all_to_all_as_on_a_cuda_mesh():
    """On a CUDA mesh DTensor's Shard(0) <-> Shard(1) is one op, torch.ops._dtensor.shard_dim_alltoall (a CPU mesh
    all-gathers and keeps a piece instead, `_collective_utils.shard_dim_alltoall`): the lesson's dispatch mode
    (course_lib.measure.dtensor_ops.Collectives) must record that op, which it sees whole, and the lesson's check
    expect it on a CUDA mesh. Shown here on a 1-rank gloo group, calling the op as the CUDA path does, so CI covers
    what a GPU node runs."""
    import torch.distributed as dist

    from course_lib.measure.dtensor_ops import Collectives

    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert any("from course_lib.measure.dtensor_ops import Collectives" in source for source in code)
    check = next(source for source in code if "swap = " in source)
    assert re.search(r'swap = "shard_dim_alltoall" if dtensor\["mesh device"\] == "cuda"', check)
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        piece = torch.arange(8.0).reshape(2, 4)
        with Collectives() as seen:
            out = torch.ops._dtensor.shard_dim_alltoall(piece, 0, 1, dist.group.WORLD.group_name)
        assert torch.equal(out, piece)   # one rank: its rows gathered, all columns kept
        assert seen.calls == [("shard_dim_alltoall", 32, 32)]
    finally:
        dist.destroy_process_group()
