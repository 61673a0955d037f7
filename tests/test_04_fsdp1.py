"""Lesson 04's exercises, graded on real gloo ranks: the solution scores full marks, the stub
zero with its hint (shown once per report), and each plausible wrong answer loses exactly the points
its mistake deserves, with a message that names the rank, the case and what is wrong; an answer that
hangs is stopped at its deadline with the rank and the collective it waits in.

One set of grading ranks serves the whole module (as the grader gives one to a submission): it is
started once, forked from a server that has imported torch.distributed.fsdp, and restarted only
after a run that failed.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import nbformat
import pytest

import grading_answers_04 as answers
from exercise_checks import (shared_ranks,
    assert_full_marks, assert_hang_is_named, assert_loses_exactly, assert_section_states_the_check,
    assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import notebook_path, exercise_sections, markdown_cells
from course_lib import theory
from course_lib.grading.cells import EXERCISE_ID, exercise_cells
from course_lib.grading.checker import check_exercise, preload_for
from course_lib.grading.lessons.lesson04.clip_grad_norm import clip_reference
from course_lib.grading.lessons.lesson04.common import ATOL, LR, RTOL
from course_lib.grading.lessons.lesson04.flat_shard_numel import flat_shard
from course_lib.grading.lessons.lesson04.memory_per_rank import UNITS_2 as MEMORY_UNITS_2
from course_lib.grading.lessons.lesson04.memory_per_rank import UNITS_3 as MEMORY_UNITS_3
from course_lib.grading.lessons.lesson04.memory_per_rank import memory_reference
from course_lib.grading.lessons.lesson04.wrap_policy import WRAP_A, WRAP_B, expected_units
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = "04_fsdp1.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("04")
POLICY, SHARD, CLIP, SAVE, MEMORY = IDS
HANG_S = 4  # the deadline of a run that hangs: long enough for the FSDP training before the hang


ranks = shared_ranks(IDS)


def _markdown(notebook: str) -> list[str]:
    return markdown_cells(notebook, NOTEBOOK)


def _sections(notebook: str) -> dict[str, str]:
    return exercise_sections(notebook, NOTEBOOK)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["04.wrap_policy", "04.flat_shard_numel", "04.clip_grad_norm", "04.full_state_dict",
                   "04.memory_per_rank"]
    cells = exercise_cells(nbformat.read(notebook_path(notebook, NOTEBOOK), as_version=4))
    assert list(cells) == IDS  # the %%exercise cells, in the registry's order
    markdown = "\n".join(_markdown(notebook))
    assert re.findall(r"^\d+\. `(\S+)`", markdown, re.M) == IDS  # the list under Goal
    assert list(_sections(notebook)) == IDS
    named = set(re.findall(rf"\b{EXERCISE_ID.pattern}\b", markdown))
    assert named <= set(IDS), f"the text names exercises nobody grades: {sorted(named - set(IDS))}"
    assert "(../notebooks/04_fsdp1.ipynb)" in markdown  # the lesson it practises


def _and(words: list[str]) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    return ", ".join(words[:-1]) + f" and {words[-1]}"


def _policy_phrases(sizes: dict) -> list[str]:
    """"`Linear(6, 8)` in `embed`, `out=5`, frozen: `embed` and `norm`": one case's model, as the text says it."""
    frozen = _and([f"`{name}`" for name in sizes["frozen"]])
    return [f"`Linear({sizes['features']}, {sizes['dim']})` in `embed`, `out={sizes['out']}`, frozen: {frozen}:"]


def _case_phrases(exercise_id: str, case: dict) -> list[str]:
    """What the text must say about one case (the world size is checked apart)."""
    n = len(case)
    if exercise_id == POLICY:
        sizes, rows = case[0][0], case[0][2].shape[0]
        units = ["the root"] + [f"`{name}`" for name in expected_units(sizes) if name]
        return [f"{sizes['layers']} Blocks", *_policy_phrases(sizes), f"the units are {_and(units)}",
                f"this rank's {rows} rows"]
    if exercise_id == SHARD:
        numels = [math.prod(shape) for shape in case[0][0]]
        return [f"{numels}` ({sum(numels)} elements)"]
    if exercise_id == MEMORY:
        units, strategy, optimizer = case[0]
        names = {"adam": "Adam", "sgd-momentum": "SGD(momentum=0.9)", "sgd": "SGD"}
        numels = [sum(math.prod(shape) for shape in shapes) for shapes in units]
        return [f"`units={units}`",
                f"units of {_and([str(k) for k in numels])} elements", f"{strategy} with {names[optimizer]}"]
    if exercise_id == CLIP:
        _, weights, inputs, targets, max_norm, _ = case[0]
        rows = inputs.shape[0]
        whole = [case[r][2] for r in range(n)], [case[r][3] for r in range(n)]
        import torch

        norm, _ = clip_reference(weights, torch.cat(whole[0]), torch.cat(whole[1]), max_norm)
        clipped = "(clipped" if norm > max_norm else "(not clipped"
        return [f"{rows} rows per rank", f"batch of {n * rows}", f"`max_norm={max_norm:g}` {clipped}"]
    policy = case[0][2]
    return [{"linears": "`ToyModel` wrapped with `ModuleWrapPolicy({torch.nn.Linear})`, one unit per Linear",
             "root": "`ToyModel` wrapped with no policy, the root the only unit"}[policy]]


def _power(tolerance: float) -> str:
    """A tolerance as the text writes it: 1e-05 -> "1e-5"."""
    return f"{tolerance:.0e}".replace("e-0", "e-")


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    """What the checks enforce (lesson04.py, rank_runner's blocked calls), as the learner reads it."""
    text = _sections("solutions")[exercise_id]
    assert_section_states_the_check(exercise_id, text, _case_phrases)
    if exercise_id in (POLICY, CLIP, SAVE):
        assert f"rtol {_power(RTOL)} and atol {_power(ATOL)}" in text
    if exercise_id in (POLICY, CLIP):
        assert f"lr {LR:g}" in text
    if exercise_id == POLICY:
        assert "Block(8, hidden)" in text and "module.parameters(recurse=False)" in text
    if exercise_id == CLIP:
        assert "relative 1e-4" in text and "max_norm / (norm + 1e-6)" in text


def test_the_shard_reference_is_fsdp1s_layout_in_theory():
    """flat_shard without alignment (the checker's words for use_orig_params=False) and cl.theory's FlatParameter
    layout agree, padding across ranks included."""
    for world in range(1, 6):
        for numels in ([1], [5], [24, 6, 12, 2], [104, 13, 65, 5], [9, 16, 5], [42, 1], [3, 3, 3, 3]):
            shards = theory.fsdp1_flat_shards([(f"p{i}", k) for i, k in enumerate(numels)], world)
            shard, padding = flat_shard(numels, world, align=1)
            assert {s.shard_numel for s in shards} == {shard}, (numels, world)
            assert sum(s.padding for s in shards) == padding == shard * world - sum(numels), (numels, world)
    assert flat_shard([5], 4, align=1) == (2, 3) and theory.fsdp1_flat_shards([("p", 5)], 4)[2].padding == 1  # on 2 ranks


def test_the_memory_reference_is_measure_steps_prediction():
    """memory_reference (the checker's words) and course_lib.measure.memory.predict_step (the lesson's formula for
    FULL_SHARD, and NO_SHARD as one rank's FSDP) agree after the step, padding and Adam's steps included."""
    from course_lib.measure.memory import predict_step

    for units in (MEMORY_UNITS_2, MEMORY_UNITS_3):
        shapes = [(f"u{i}.p{j}" if i else f"p{j}", shape) for i, unit in enumerate(units) for j, shape in
                  enumerate(unit)]
        prefixes = [f"u{i}" for i in range(1, len(units))]
        for world in (2, 3, 4):
            for optimizer in ("adam", "sgd-momentum", "sgd"):
                for strategy, size in (("FULL_SHARD", world), ("NO_SHARD", 1)):
                    step = predict_step(shapes, strategy="fsdp1", world_size=size, rank=0, units=prefixes,
                                        optimizer=optimizer)["phases"]["step"]
                    expected = {k: step[k] for k in ("parameters", "gradients", "optimizer")}
                    assert memory_reference(units, strategy, world, optimizer) == expected, (units, world, strategy)
                    assert memory_reference(units, "SHARD_GRAD_OP", world, optimizer) == \
                        memory_reference(units, "FULL_SHARD", world, optimizer)


def test_the_policy_cases_need_each_rule():
    """Each case has frozen modules outside the Blocks, beside a container left with nothing (embed) and a ReLU;
    the 3-rank case a frozen Linear inside a Block; and trainable parameters outside the Blocks, so that the
    lesson's ModuleWrapPolicy({Block}) mixes them with frozen ones in the root's unit (torch's refusal is the
    policy-blocks-only wrong answer below)."""
    from course_lib.grading.lessons.lesson04.drivers import wrap_model

    assert expected_units(WRAP_A) == ["", "embed.0", "embed.1", "blocks.0", "blocks.1", "norm"]
    assert expected_units(WRAP_B) == ["", "embed.0", "embed.1", "blocks.0", "blocks.0.up", "blocks.1", "blocks.2"]
    for sizes in (WRAP_A, WRAP_B):
        outside = {p.requires_grad for n, p in wrap_model(sizes).named_parameters() if not n.startswith("blocks.")}
        assert outside == {True, False}, sizes


def test_the_exercises_fork_their_ranks_with_fsdp_imported(ranks):
    """FSDP's package is about 130 modules (0.8 s a process): the server imports it once, before forking."""
    assert preload_for([exercise(i) for i in IDS]) == ("torch.distributed.fsdp",)
    found = exercise(SHARD)
    cell = answers.SHARD_SOLUTION.replace(
        "def shard_numel", "import sys\n\nassert 'torch.distributed.fsdp' in sys.modules, 'not preloaded'\n\n\n"
        "def shard_numel", 1)
    items = check_exercise(dataclasses.replace(found, runs=found.runs[:1]), cell, ranks=ranks)
    assert all(item.passed for item in items), "\n".join(map(item_line, items))


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_shows_its_first_hint_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


UNITS_2, POLICY_STEP_2, UNITS_3, POLICY_STEP_3 = (
    "the FSDP units: the root, each Block, embed.0, embed.1 and norm (2 ranks)",
    "one SGD step equals one process on the whole batch (2 ranks)",
    "the FSDP units: the root, each Block, embed.0, embed.1 and blocks.0.up (3 ranks)",
    "one SGD step equals one process on the whole batch (3 ranks)")
NUMEL_2, PAD_2, NUMEL_3, PAD_3 = (
    "the shard's numel equals FSDP's on every rank (2 ranks: 44 and 187 elements)",
    "the padding equals FSDP's (2 ranks: 44 and 187 elements)",
    "the shard's numel equals FSDP's on every rank (3 ranks: 44, 30 and 45 elements)",
    "the padding equals FSDP's (3 ranks: 44, 30 and 45 elements)")
NORM_2, GRADS_2, STEP_2, NORM_3, GRADS_3, STEP_3 = (
    "returns the total gradient norm on every rank (2 ranks, clipped and not)",
    "every rank's gradient shards are clipped by it (2 ranks, clipped and not)",
    "an SGD step then gives one process's parameters (2 ranks)",
    "returns the total gradient norm on every rank (3 ranks, clipped and not)",
    "every rank's gradient shards are clipped by it (3 ranks, clipped and not)",
    "an SGD step then gives one process's parameters (3 ranks)")
LOAD_0_2, LOAD_1_2, LOAD_0_3, LOAD_OTHERS_3 = (
    "rank 0's shards hold the file's values (2 ranks, one unit per Linear)",
    "rank 1's shards hold the file's values (2 ranks, one unit per Linear)",
    "rank 0's shards hold the file's values (3 ranks, the root only)",
    "ranks 1 and 2's shards hold the file's values (3 ranks, the root only)")
CASE_A = "rank 0, case 1 of 1 (2 Blocks, frozen: embed, norm): the FSDP units are "
CASE_B = "rank 0, case 1 of 1 (3 Blocks, frozen: embed, blocks.0.up): the FSDP units are "
UNITS_A = "['', 'embed.0', 'embed.1', 'blocks.0', 'blocks.1', 'norm']"
UNITS_B = "['', 'embed.0', 'embed.1', 'blocks.0', 'blocks.0.up', 'blocks.1', 'blocks.2']"
MIXED = ("rank 0 raised: ValueError: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`: "
         "{} would hold frozen {} and trainable {} in one FlatParameter, which has one requires_grad; a frozen module "
         "needs a unit of its own (FSDP asks about it before its parent)")
NOT_ASKED = ("is a Block: every Block must be a unit of its own; FSDP asks whether to make a module a unit "
             "(recurse=False) only if it was let inside it (recurse=True)")
SHARD_44_2 = "rank 0, case 1 of 2 (param_numels=[24, 6, 12, 2], 44 elements, world_size=2): "
SHARD_44_3 = "rank 0, case 1 of 3 (param_numels=[24, 6, 12, 2], 44 elements, world_size=3): "
SHARD_30 = "rank 0, case 2 of 3 (param_numels=[9, 16, 5], 30 elements, world_size=3): "
NO_ALIGNMENT = ("that is use_orig_params=False's layout, the parameters back to back; with use_orig_params=True each "
                "parameter starts on a 16-byte boundary, which may leave zeros between them")
ALIGNS_END = ("that aligns the end of the last parameter too; alignment is where a parameter starts, and only the "
              "world size pads the end")
CLIP_A2 = "rank 0, case 1 of 2 (max_norm=0.5, batch of 8 split over 2 ranks): "
CLIP_A3 = "rank 0, case 1 of 2 (max_norm=0.3, batch of 6 split over 3 ranks): "
CLIP_B2 = "rank 0, case 2 of 2 (max_norm=50, batch of 8 split over 2 ranks): "
CLIP_B3 = "rank 0, case 2 of 2 (max_norm=100, batch of 6 split over 3 ranks): "
STEP_WRONG = "after clipping and an SGD step (lr 0.1): blocks.0.up.weight element [0, 0] is "
REFUSED = "is what this exercise asks you to build: it is not allowed here"
NO_FILE = ("raised at cell line 11: FileNotFoundError: no file model_case1.pt on rank {}: the file is on rank 0's disk "
           "only (each rank here has a folder of its own, as nodes have disks of their own); rank 0 reads it and "
           "sends each tensor")
BEFORE = "still holds the model's values from before the load"
NOT_SENT = (BEFORE + ", not the file's: rank 0 alone can read the file, so each tensor must come from rank 0 "
            "(dist.broadcast), and every rank must load what arrived")
NOT_LOADED = (BEFORE + ": rank 0 read the file, but the state dict's tensors are copies (FSDP1 clones what it "
              "gathers); the model changes only by model.load_state_dict(...)")
LINEARS, ROOT_ONLY = "case 1 of 1 (ToyModel, one unit per Linear): ", "case 1 of 1 (ToyModel, the root the only unit): "
PICKLED = ("rank 0 raised at cell line 16: RuntimeError: 04.full_state_dict may use only all_gather, "
           "all_gather_into_tensor, all_gather_single, broadcast, reduce_scatter_single, reduce_scatter_tensor: "
           "dist.broadcast_object_list is not allowed here")

# A wrong policy that FSDP accepts still trains right (units change the communication, not the result): it loses
# the units' points only; one FSDP refuses loses all. A wrong load loses the ranks whose shards it leaves wrong.
WRONG = [
    # The lesson's ModuleWrapPolicy({Block}) by hand: the root's unit mixes frozen and trainable; torch refuses it.
    # (3 ranks: blocks.0, with its frozen up, is the first unit FSDP builds and refuses.)
    pytest.param(POLICY, answers.POLICY_BLOCKS_ONLY, {
        **{name: MIXED.format("the root's unit", "embed.0.weight, embed.0.bias, embed.1.weight",
                              "head.0.weight, head.0.bias, head.2.weight") for name in (UNITS_2, POLICY_STEP_2)},
        **{name: MIXED.format("the unit blocks.0", "blocks.0.up.weight, blocks.0.up.bias",
                              "blocks.0.down.weight, blocks.0.down.bias") for name in (UNITS_3, POLICY_STEP_3)},
    }, id="policy-blocks-only"),
    # all() of module.parameters() with nothing left to hold: embed (its units' FlatParameters frozen) and the ReLU
    # become units of nothing; the step is right.
    pytest.param(POLICY, answers.POLICY_ALL_FROZEN, {
        UNITS_2: CASE_A + "['', 'embed', 'embed.0', 'embed.1', 'blocks.0', 'blocks.1', 'norm', 'head.1'], expected "
                 + UNITS_A + ": embed (Sequential) has nothing left to hold (its children are units already, their "
                 "FlatParameters frozen), yet it became a unit of 0 parameters: a module with nonwrapped_numel 0 is "
                 "not a unit",
        UNITS_3: CASE_B + "['', 'embed', 'embed.0', 'embed.1', 'blocks.0', 'blocks.0.up', 'blocks.1', 'blocks.2', "
                 "'head.1'], expected " + UNITS_B + ": embed (Sequential) has nothing left to hold",
    }, id="policy-all-frozen-units-of-nothing"),
    # Not looking inside a Block: the Blocks are never asked to be units (2 ranks), and blocks.0's frozen up stays in
    # the root's unit with trainable parameters (3 ranks).
    pytest.param(POLICY, answers.POLICY_NOT_INSIDE_BLOCKS, {
        UNITS_2: CASE_A + "['', 'embed.0', 'embed.1', 'norm'], expected " + UNITS_A + ": blocks.0 " + NOT_ASKED,
        UNITS_3: MIXED.format("the root's unit", "blocks.0.up.weight, blocks.0.up.bias",
                              "blocks.0.down.weight, blocks.0.down.bias, blocks.1.up.weight"),
        POLICY_STEP_3: MIXED.format("the root's unit", "blocks.0.up.weight, blocks.0.up.bias",
                                    "blocks.0.down.weight, blocks.0.down.bias, blocks.1.up.weight"),
    }, id="policy-not-inside-blocks"),
    # No recurse branch: FSDP looks no further than the root, which holds everything.
    pytest.param(POLICY, answers.POLICY_NO_RECURSE, {
        name: ("rank 0 raised: ValueError: Must flatten tensors with uniform `requires_grad`", "the root's unit would "
               "hold frozen embed.0.weight, embed.0.bias, embed.1.weight and trainable blocks.0.")
        for name in (UNITS_2, POLICY_STEP_2, UNITS_3, POLICY_STEP_3)}, id="policy-without-recurse"),
    pytest.param(POLICY, answers.POLICY_NO_BLOCKS, {
        UNITS_2: CASE_A + "['', 'embed.0', 'embed.1', 'norm'], expected " + UNITS_A + ": blocks.0 " + NOT_ASKED,
        UNITS_3: CASE_B + "['', 'embed.0', 'embed.1', 'blocks.0.up'], expected " + UNITS_B + ": blocks.0 " + NOT_ASKED,
    }, id="policy-without-blocks"),
    pytest.param(SHARD, answers.SHARD_NO_ALIGNMENT, {
        NUMEL_2: SHARD_44_2 + "shard numel is 22, FSDP's shard on rank 0 holds 23 elements: " + NO_ALIGNMENT,
        PAD_2: SHARD_44_2 + "padding is 0, the FlatParameter FSDP built holds 2 elements of padding: " + NO_ALIGNMENT,
        NUMEL_3: SHARD_44_3 + "shard numel is 15, FSDP's shard on rank 0 holds 16 elements: " + NO_ALIGNMENT,
        PAD_3: SHARD_44_3 + "padding is 1, the FlatParameter FSDP built holds 4 elements of padding: " + NO_ALIGNMENT,
    }, id="shard-without-alignment"),
    pytest.param(SHARD, answers.SHARD_ALIGNS_16_ELEMENTS, {
        NUMEL_2: SHARD_44_2 + "shard numel is 33, FSDP's shard on rank 0 holds 23 elements: 16 bytes are not 16 "
                              "elements: a float32 element is 4 bytes",
        PAD_2: "padding is 22, the FlatParameter FSDP built holds 2 elements of padding: 16 bytes are not 16 elements",
        NUMEL_3: "shard numel is 22, FSDP's shard on rank 0 holds 16 elements: 16 bytes are not 16 elements",
        PAD_3: "padding is 22, the FlatParameter FSDP built holds 4 elements of padding: 16 bytes are not 16 elements",
    }, id="shard-aligns-to-16-elements"),
    # [24, 6, 12, 2] on 3 ranks: aligning the end changes nothing there (46 -> 48 either way); [9, 16, 5] catches it.
    pytest.param(SHARD, answers.SHARD_ALIGNS_END, {
        NUMEL_2: SHARD_44_2 + "shard numel is 24, FSDP's shard on rank 0 holds 23 elements: " + ALIGNS_END,
        PAD_2: SHARD_44_2 + "padding is 4, the FlatParameter FSDP built holds 2 elements of padding: " + ALIGNS_END,
        NUMEL_3: SHARD_30 + "shard numel is 12, FSDP's shard on rank 0 holds 11 elements: " + ALIGNS_END,
        PAD_3: SHARD_30 + "padding is 6, the FlatParameter FSDP built holds 3 elements of padding: " + ALIGNS_END,
    }, id="shard-aligns-the-end"),
    # 46 elements on 2 ranks divide evenly: floor division is right there; 193 is where it fails.
    pytest.param(SHARD, answers.SHARD_FLOOR, {
        NUMEL_2: "rank 0, case 2 of 2 (param_numels=[104, 13, 65, 5], 187 elements, world_size=2): shard numel is 96, "
                 "FSDP's shard on rank 0 holds 97 elements: that is floor division (193 // 2); the FlatParameter is "
                 "padded to a multiple of the world size",
        PAD_2: "padding is 6, the FlatParameter FSDP built holds 7 elements of padding: that is floor division",
        NUMEL_3: SHARD_44_3 + "shard numel is 15, FSDP's shard on rank 0 holds 16 elements: that is floor division "
                              "(46 // 3)",
        PAD_3: "padding is 2, the FlatParameter FSDP built holds 4 elements of padding: that is floor division",
    }, id="shard-floor-division"),
    # The shard is right; only the padding of an end that divides evenly is wrong.
    pytest.param(SHARD, answers.SHARD_PADS_WHEN_EVEN, {
        PAD_2: SHARD_44_2 + "padding is 4, the FlatParameter FSDP built holds 2 elements of padding: 46 elements "
                            "divide evenly by 2, so nothing is added at the end",
        PAD_3: SHARD_30 + "padding is 6, the FlatParameter FSDP built holds 3 elements of padding: 33 elements divide "
                          "evenly by 3",
    }, id="shard-pads-when-even"),
    pytest.param(CLIP, answers.CLIP_LOCAL, {
        NORM_2: CLIP_A2 + "the norm is 1.2341, expected 1.57306 (all gradients, every rank's shard): that is the norm "
                          "of this rank's shard only (model.parameters() yields this rank's FlatParameter shards)",
        GRADS_2: CLIP_A2 + "this rank's shard of head.weight's gradient (elements 0 to 22) element 0 is -0.0644209, "
                           "expected -0.0505395: clipped by another norm than the total, 1.57306",
        STEP_2: STEP_WRONG + "-0.0314526, expected -0.0316889",
        NORM_3: CLIP_A3 + "the norm is 1.10533, expected 1.78757 (all gradients, every rank's shard): that is the norm "
                          "of this rank's shard only",
        GRADS_3: "clipped by another norm than the total, 1.78757",
        STEP_3: STEP_WRONG,
    }, id="clip-this-ranks-norm-only"),
    pytest.param(CLIP, answers.CLIP_SUMS_NORMS, {
        NORM_2: CLIP_A2 + "the norm is 2.20956, expected 1.57306 (all gradients, every rank's shard): that is the sum "
                          "of the ranks' shard norms; norms do not add: their squares do",
        GRADS_2: "clipped by another norm than the total, 1.57306",
        STEP_2: STEP_WRONG,
        NORM_3: "the norm is 3.09203, expected 1.78757 (all gradients, every rank's shard): that is the sum of the "
                "ranks' shard norms",
        GRADS_3: "clipped by another norm than the total, 1.78757",
        STEP_3: STEP_WRONG,
    }, id="clip-sums-the-norms"),
    pytest.param(CLIP, answers.CLIP_MAX, {
        NORM_2: CLIP_A2 + "the norm is 1.2341, expected 1.57306 (all gradients, every rank's shard): that is the "
                          "largest of the ranks' shard norms (an all-reduce with MAX)",
        GRADS_2: "clipped by another norm than the total, 1.57306",
        STEP_2: STEP_WRONG,
        NORM_3: CLIP_A3 + "the norm is 1.10533, expected 1.78757 (all gradients, every rank's shard): that is the "
                          "largest of the ranks' shard norms",
        GRADS_3: "clipped by another norm than the total, 1.78757",
        STEP_3: STEP_WRONG,
    }, id="clip-max-of-the-norms"),
    # Only the cases whose norm is below max_norm fail: the norm itself is right.
    pytest.param(CLIP, answers.CLIP_ALWAYS_SCALES, {
        GRADS_2: CLIP_B2 + "this rank's shard of head.weight's gradient (elements 0 to 22) element 0 is 2.45768, "
                           "expected 0.104748: the norm 2.13103 is below max_norm=50, so the gradients must stay as "
                           "they are (the factor is at most 1)",
        STEP_2: CLIP_B2[:-2] + ", " + STEP_WRONG + "-0.0369916, expected -0.0168026",
        GRADS_3: CLIP_B3 + "this rank's shard of head.weight's gradient (elements 0 to 14) element 0 is 19.7633, "
                           "expected 0.437913: the norm 2.21578 is below max_norm=100",
        STEP_3: STEP_WRONG,
    }, id="clip-scales-up-below-max-norm"),
    pytest.param(CLIP, answers.CLIP_WITH_TORCH, {
        item: "rank 0 raised at cell line 7: RuntimeError: torch.nn.utils.clip_grad_norm_ " + REFUSED
        for item in (NORM_2, GRADS_2, STEP_2, NORM_3, GRADS_3, STEP_3)
    }, id="clip-with-torch-refused"),
    pytest.param(CLIP, answers.CLIP_WITH_FSDP, {
        item: "rank 0 raised at cell line 7: RuntimeError: FullyShardedDataParallel.clip_grad_norm_ " + REFUSED
        for item in (NORM_2, GRADS_2, STEP_2, NORM_3, GRADS_3, STEP_3)
    }, id="clip-with-fsdp-refused"),
    # The lesson's reload, where only rank 0 has the file: the others find none.
    pytest.param(SAVE, answers.LOAD_EVERY_RANK_READS, {
        LOAD_0_2: "rank 1 " + NO_FILE.format(1), LOAD_1_2: "rank 1 " + NO_FILE.format(1),
        # ranks 1 and 2 both raise: the report names the one that ended first
        LOAD_0_3: tuple(NO_FILE.split("{}")), LOAD_OTHERS_3: tuple(NO_FILE.split("{}")),
    }, id="load-every-rank-reads-the-file"),
    # Rank 0 loads the file's values, the others their own back: rank 0's point only.
    pytest.param(SAVE, answers.LOAD_NO_BROADCAST, {
        LOAD_1_2: "rank 1, " + LINEARS + "its shard of blocks.0.up.weight (elements 59 to 103 of the flattened "
                  "tensor) " + NOT_SENT,
        LOAD_OTHERS_3: "rank 1, " + ROOT_ONLY + "its shard of blocks.0.down.weight (elements 51 to 103 of the "
                       "flattened tensor) " + NOT_SENT,
    }, id="load-without-broadcast"),
    pytest.param(SAVE, answers.LOAD_NOT_LOADED, {
        LOAD_0_2: "rank 0, " + LINEARS + "its shard of blocks.0.up.weight (elements 0 to 58 of the flattened tensor) "
                  + NOT_LOADED,
        LOAD_1_2: "rank 1, " + LINEARS + "its shard of blocks.0.up.weight (elements 59 to 103 of the flattened "
                  "tensor) " + NOT_SENT,
        LOAD_0_3: "rank 0, " + ROOT_ONLY + "its shard of blocks.0.up.weight (elements 0 to 103 of the flattened "
                  "tensor) " + NOT_LOADED,
        LOAD_OTHERS_3: "rank 1, " + ROOT_ONLY + "its shard of blocks.0.down.weight",
    }, id="load-broadcast-never-loaded"),
    pytest.param(SAVE, answers.LOAD_PICKLED, {
        item: PICKLED for item in (LOAD_0_2, LOAD_1_2, LOAD_0_3, LOAD_OTHERS_3)}, id="load-pickled-dict-refused"),
]


MEMORY_ITEMS = {n: [f"{what} per rank after the step, FULL_SHARD, SHARD_GRAD_OP and NO_SHARD ({n} ranks)"
                    for what in ("parameters", "gradients", "optimizer state")] for n in (2, 3)}
(PARAMS_M2, GRADS_M2, OPTIM_M2), (PARAMS_M3, GRADS_M3, OPTIM_M3) = MEMORY_ITEMS[2], MEMORY_ITEMS[3]
MEMORY_CASE_2 = "rank 0, case {} of 3 ({}, units of 21, 36, 9 elements, world_size=2): "
MEMORY_CASE_3 = "rank 0, case {} of 3 ({}, units of 48, 50, 56, 4 elements, world_size=3): "
NO_PADDING = "no padding: a FlatParameter is padded to a multiple of the world size before it is split"
WRONG += [
    pytest.param(MEMORY, answers.MEMORY_NO_PADDING, {
        PARAMS_M2: MEMORY_CASE_2.format(1, "FULL_SHARD, adam") + "parameters 128 B, the rank measured 136 B: "
        + NO_PADDING,
        GRADS_M2: NO_PADDING, OPTIM_M2: "optimizer 268 B, the rank measured 284 B: " + NO_PADDING,
        PARAMS_M3: MEMORY_CASE_3.format(1, "FULL_SHARD, sgd-momentum") + "parameters 204 B, the rank measured "
        "216 B: " + NO_PADDING,
        GRADS_M3: NO_PADDING, OPTIM_M3: NO_PADDING,
    }, id="memory-without-padding"),
    pytest.param(MEMORY, answers.MEMORY_SHARD_GRAD_OP_WHOLE, {
        PARAMS_M2: MEMORY_CASE_2.format(2, "SHARD_GRAD_OP, sgd-momentum") + "parameters 264 B, the rank measured "
        "136 B: SHARD_GRAD_OP's parameters counted whole: between steps (after optimizer.step()) it keeps only each "
        "rank's shard",
        PARAMS_M3: MEMORY_CASE_3.format(2, "SHARD_GRAD_OP, adam") + "parameters 632 B, the rank measured 216 B: "
        "SHARD_GRAD_OP's parameters counted whole",
    }, id="memory-shard-grad-op-parameters-whole"),
    pytest.param(MEMORY, answers.MEMORY_NO_SHARD_GRADS_SHARDED, {
        GRADS_M2: MEMORY_CASE_2.format(3, "NO_SHARD, adam") + "gradients 136 B, the rank measured 264 B: NO_SHARD's "
        "gradients counted sharded: NO_SHARD all-reduces every gradient (DDP), so each rank holds all of them",
        GRADS_M3: MEMORY_CASE_3.format(3, "NO_SHARD, sgd") + "gradients 216 B, the rank measured 632 B: NO_SHARD's "
        "gradients counted sharded",
    }, id="memory-no-shard-gradients-sharded"),
    pytest.param(MEMORY, answers.MEMORY_ADAM_ONE_TENSOR, {
        OPTIM_M2: MEMORY_CASE_2.format(1, "FULL_SHARD, adam") + "optimizer 136 B, the rank measured 284 B: Adam's "
        "state counted as one tensor per parameter: it keeps two (exp_avg and exp_avg_sq) and a step",
        OPTIM_M3: MEMORY_CASE_3.format(2, "SHARD_GRAD_OP, adam") + "optimizer 216 B, the rank measured 448 B: "
        "Adam's state counted as one tensor per parameter",
    }, id="memory-adam-one-tensor"),
    pytest.param(MEMORY, answers.MEMORY_STEP_PER_PARAMETER, {
        OPTIM_M2: MEMORY_CASE_2.format(1, "FULL_SHARD, adam") + "optimizer 292 B, the rank measured 284 B: Adam's "
        "step counted per original parameter: the optimizer sees one parameter per FlatParameter",
        OPTIM_M3: "optimizer 460 B, the rank measured 448 B: Adam's step counted per original parameter",
    }, id="memory-adam-step-per-parameter"),
]


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    assert_loses_exactly(exercise_id, source, lost, ranks=ranks)


HANGS = [
    # The squared norms' all-reduce on rank 0 only: rank 1 never calls it.
    pytest.param(CLIP, answers.CLIP_ON_RANK_0_ONLY, [
        "rank 0 is still in your function: it is waiting in all_reduce #1 (4 B, world group)",
        "rank 1 finished your function and waits in the checker's all_gather (world group)"], id="clip-on-rank-0-only"),
    # FSDP's load gathers every unit: rank 0 alone waits in the first all-gather.
    pytest.param(SAVE, answers.LOAD_ON_RANK_0_ONLY, [
        "rank 0 is still in your function: it is waiting in all_gather #1",
        "rank 1 finished your function and waits in the checker's"],
        id="load-on-rank-0-only"),
]


@pytest.mark.parametrize("exercise_id, source, phrases", HANGS)
def test_an_answer_that_hangs_is_stopped_at_its_deadline_naming_the_rank_and_collective(
        exercise_id, source, phrases, ranks):
    assert_hang_is_named(exercise_id, source, phrases, ranks, HANG_S)
