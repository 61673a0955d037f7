"""Lesson 05's exercises, graded on real gloo ranks: the solution scores full marks, the stub
zero with its hint (shown once per report), and each plausible wrong answer loses exactly the points
its mistake deserves, with a message that names the rank, the case and what is wrong; an answer that
hangs is stopped at its deadline with the rank and the collective it waits in.

One set of grading ranks serves the whole module (as the grader gives one to a submission): it is
started once, forked from a server that has imported torch.distributed.fsdp and
torch.distributed.checkpoint.state_dict, and restarted only after a run that failed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import nbformat
import pytest
import torch

import grading_answers_05 as answers
from exercise_checks import (shared_ranks,
    assert_full_marks, assert_hang_is_named, assert_loses_exactly, assert_section_states_the_check,
    assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import assert_lists_exactly, notebook_path, exercise_sections, markdown_cells
from course_lib import theory
from course_lib.grading.cells import exercise_cells
from course_lib.grading.checker import check_exercise, preload_for
from course_lib.grading.lessons.lesson05.exercises import (
    ATOL, FSDP2_OPS, LR, RTOL, TOY_3, group_elements, shard_rows)
from course_lib.grading.lessons.lesson05.shard_bottom_up import TIED_2, TIED_4
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line
from course_lib.vocabulary import canonical_op

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = "05_fsdp2.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("05")
SHARD, ZERO3, ACCUMULATE, META, HSDP = IDS
HANG_S = 4  # the deadline of a run that hangs: long enough for the sharding and the checker's reference


ranks = shared_ranks(IDS)


def _rows(count: int) -> str:
    return f"{count} row{'s' * (count != 1)}"


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["05.shard_bottom_up", "05.zero3_linear", "05.accumulate", "05.meta_init_broadcast", "05.hsdp_mesh"]
    assert_lists_exactly(notebook, NOTEBOOK, IDS)


def _head_rows(n: int) -> str:
    """"the head's 5 rows are held 2, 2, 1 and 0": how the text says the head is cut on n ranks."""
    sizes = [stop - start for start, stop in (shard_rows(TOY_3["out"], n, r) for r in range(n))]
    return f"the head's {TOY_3['out']} rows are held {', '.join(map(str, sizes[:-1]))} and {sizes[-1]}"


def _case_phrases(exercise_id: str, case: dict) -> list[str]:
    """What the text must say about one case (the world size is checked apart)."""
    n = len(case)
    if exercise_id == SHARD:
        sizes, rows = case[0][0], case[0][2].shape[0]
        stages = sizes["stages"]
        counts = ", ".join(map(str, stages[:-1])) + f" and {stages[-1]}"
        return [f"stages of {counts} Blocks, vocab {sizes['vocab']}", f"this rank's {_rows(rows)} of a batch of {n * rows}"]
    if exercise_id == ZERO3:
        weights, inputs = case[0][0], case[0][1]
        (hidden, features), out = weights["0.weight"].shape, weights["2.weight"].shape[0]
        rows = inputs.shape[0]
        return [f"`Linear({features}, {hidden})` → ReLU → `Linear({hidden}, {out})`, {hidden // n} and {out // n} "
                f"rows of the two weights per rank, this rank's {_rows(rows)} of a batch of {n * rows}"]
    if exercise_id == HSDP:
        sizes, _, inputs, _, _, shard_size, steps = case[0]
        rows = inputs.shape[0]
        return [f"`ToyModel` with {sizes['layers']} Blocks, `shard_size={shard_size}`, this rank's {_rows(rows)} of a "
                f"batch of {n * rows}", f"after {steps} SGD steps (lr {LR:g})"]
    if exercise_id == ACCUMULATE:
        sizes, _, micro_batches, _ = case[0]
        k, rows = len(micro_batches), micro_batches[0][0].shape[0]
        return [f"{sizes['layers']} Blocks, K={k} micro-batches of {_rows(rows)} per rank (a batch of {n * k * rows} "
                "rows)"]
    sizes = case[0][0]
    return [f"{n} ranks: {sizes['layers']} Blocks"] + ([_head_rows(n)] if n == 4 else [])


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    """What the checks enforce (lesson05.py, rank_runner's blocked calls), as the learner reads it."""
    text = exercise_sections("solutions", NOTEBOOK)[exercise_id]
    assert_section_states_the_check(exercise_id, text, _case_phrases)
    assert f"rtol {RTOL:.0e} and atol {ATOL:.0e}".replace("e-0", "e-") in text
    if exercise_id in (SHARD, ACCUMULATE):
        assert f"lr {LR:g}" in text or f"lr={LR:g}" in text
    if exercise_id in (SHARD, META):
        assert '`init_device_mesh(device_type, (dist.get_world_size(),))`' in markdown_cells("solutions", NOTEBOOK)[0]


def test_the_rows_each_rank_holds_are_fsdp2s_in_theory():
    """shard_rows (the checker's words) tile dim 0 in torch.chunk's pieces, as cl.theory's FSDP2 layout says."""
    for world in range(1, 6):
        for rows in (1, 2, 5, 8, 13, 17):
            pieces = [shard_rows(rows, world, r) for r in range(world)]
            assert [stop - start for start, stop in pieces] == \
                [theory.fsdp2_local_shape((rows, 3), world, r)[0] for r in range(world)]
            assert pieces[0][0] == 0 and pieces[-1][1] == rows  # together, every row once, in rank order
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
            chunks = torch.arange(rows).chunk(world)
            assert [list(range(*p)) for p in pieces[:len(chunks)]] == [c.tolist() for c in chunks]
    assert [shard_rows(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # rank 3: no rows


@pytest.mark.parametrize("n, sizes", [(2, TIED_2), (4, TIED_4)])
def test_the_forward_all_gathers_judged_are_theorys(n, sizes):
    """The bytes 05.shard_bottom_up expects of the forward's all-gathers are cl.theory's FSDP2 step, forward part:
    one group per Block, one for the tied pair (its weight counted once), the root's (the norm)."""
    from course_lib.grading.lessons.lesson05.drivers import tied_model

    weights = tied_model(sizes).state_dict()
    block, pair, root = group_elements(sizes, weights, n)
    units = [[tuple(v.shape) for k, v in weights.items() if k.startswith("norm.")], [tuple(weights["embed.weight"].shape)]]
    units += [[tuple(v.shape) for k, v in weights.items() if k.startswith("stages.0.0.")]] * sum(sizes["stages"])
    steps = theory.fsdp2_step_collectives(units, n)
    forward = steps[:len(units)]
    assert [canonical_op(op) for op, _ in forward] == ["all_gather_single"] * len(units)
    assert sorted(nbytes for _, nbytes in forward) == sorted([4 * root, 4 * pair] + [4 * block] * sum(sizes["stages"]))


def test_the_exercises_fork_their_ranks_with_fsdp_imported(ranks):
    """fully_shard's package, torch._dynamo (which the first fully_shard imports: 2.4 s for 2 ranks) and the
    checkpoint state dict's: the server imports them once, before forking."""
    assert preload_for([exercise(i) for i in IDS]) == ("torch._dynamo", "torch.distributed.checkpoint.state_dict",
                                                        "torch.distributed.fsdp")
    found = exercise(ZERO3)
    cell = answers.ZERO3_SOLUTION.replace(
        "def gather_rows", "import sys\n\nassert {'torch.distributed.fsdp', 'torch._dynamo'} <= set(sys.modules), "
        "'not preloaded'\n\n\ndef gather_rows", 1)
    items = check_exercise(dataclasses.replace(found, runs=found.runs[:1]), cell, ranks=ranks)
    assert all(item.passed for item in items), "\n".join(map(item_line, items))


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    """For 05.zero3_linear this also shows fully_shard's own gradient shards equal one process's rows: the
    judge compares the answer with both."""
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_says_what_to_write_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


UNITS_2, STEP_2, GATHERS_2, UNITS_4, STEP_4, GATHERS_4 = (
    "the groups: each Block, embed and head together, the root; every parameter Shard(0) on all 2 ranks",
    "one SGD step equals one process on the whole batch (2 ranks)",
    "the forward all-gathers once per group (2 ranks)",
    "the groups: each Block, embed and head together, the root; every parameter Shard(0) on all 4 ranks",
    "one SGD step equals one process on the whole batch (4 ranks)",
    "the forward all-gathers once per group (4 ranks)")
VALUES_2, STEPS_2, FREED_2, SCATTERED_2, VALUES_4, STEPS_4, FREED_4, SCATTERED_4 = (
    "outputs and the shards' gradients equal one process (2 ranks)",
    "the shards after 3 SGD steps equal one process (2 ranks)",
    "forward frees the gathered weight, backward gathers it again (2 ranks)",
    "gradients reduce-scattered, no all-reduce (2 ranks)",
    "outputs and the shards' gradients equal one process (4 ranks)",
    "the shards after 3 SGD steps equal one process (4 ranks)",
    "forward frees the gathered weight, backward gathers it again (4 ranks)",
    "gradients reduce-scattered, no all-reduce (4 ranks)")
HSDP_PLACED, HSDP_LEDGER, HSDP_STEPS = (
    "a 2 x 2 mesh: Replicate() over 'replicate', Shard(0) over 'shard', shard groups of consecutive ranks",
    "per mesh dim: all-gathers and reduce-scatters in the shard group, all-reduces across the replicas",
    "2 SGD steps equal one process on the whole batch")
ACC_STEP_2, ACC_GATHER_2, ACC_SYNC_2, ACC_SHARDED_2, ACC_STEP_4, ACC_GATHER_4, ACC_SYNC_4 = (
    "one step equals one process on the whole batch (2 ranks, K=3)",
    "each group all-gathers once, in the first micro-batch (2 ranks, K=3)",
    "reduce-scatters only in the last micro-batch (2 ranks, K=3)",
    "every parameter is sharded again at the end (2 ranks, K=3)",
    "one step equals one process on the whole batch (4 ranks, K=2)",
    "each group all-gathers once, in the first micro-batch (4 ranks, K=2)",
    "reduce-scatters only in the last micro-batch (4 ranks, K=2)")
META_BUILT_2, META_VALUES_2, META_BUFFERS_2, META_BUILT_4, META_VALUES_4, META_BUFFERS_4 = (
    "built on the meta device, every parameter Shard(0) on the CPU (2 ranks)",
    "every rank's rows equal rank 0's state dict (2 ranks)",
    "both buffers and the output equal one process's (2 ranks)",
    "built on the meta device, every parameter Shard(0) on the CPU (4 ranks)",
    "every rank's rows equal rank 0's state dict (4 ranks)",
    "both buffers and the output equal one process's (4 ranks)")
TOY_CASE_2 = "rank 0, case 1 of 1 (ToyModel with 2 Blocks, 2 rows per rank): "
TOY_CASE_4 = "rank 0, case 1 of 1 (ToyModel with 3 Blocks, 1 row per rank): "
LINEAR_2 = "rank 0, case 1 of 1 (Linear(6, 8) -> ReLU -> Linear(8, 4), 3 rows of the batch per rank): "
LINEAR_4 = "rank 0, case 1 of 1 (Linear(5, 12) -> ReLU -> Linear(12, 4), 2 rows of the batch per rank): "
HSDP_CASE = "rank 0, case 1 of 1 (ToyModel with 2 Blocks, shard groups of 2 ranks, 2 rows per rank)"
MICRO_2 = "rank 0, case 1 of 1 (ToyModel with 2 Blocks, K=3 micro-batches of 2 rows per rank): "
MICRO_4 = "rank 0, case 1 of 1 (ToyModel with 3 Blocks, K=2 micro-batches of 1 row per rank): "
ROOT_FIRST = ("RuntimeError: TypeError: Invariant encountered: value was None when it should not be: "
              "fully_shard(model) ran before fully_shard on the Blocks. The root's call already made every parameter "
              "below it, the Blocks' too, a DTensor of the root's group")
# Ranks 2 and 3 both raise: the report names the lowest that has ended when the others are stopped.
MESH_OF_2 = (" raised at cell line 10: RuntimeError: IndexError: list index out of range: the mesh holds ranks [0, 1], "
             "2 of the 4 ranks (rank ", " is not in it); FSDP's 1-D mesh holds every rank: "
             "init_device_mesh(device_type, (dist.get_world_size(),)), not a size written in the code")
ALL_REDUCE = ("all_reduce of {} B = {} floats: every rank receives the whole gradient and keeps only its rows of it; "
              "a reduce-scatter gives each rank only its rows, with half the traffic")
NO_FREE = ("during forward autograd saved a tensor of shape {} for backward, {} B = {} floats: the size of layer 1's "
           "whole weight {}. ZeRO-3 frees the gathered weight after forward: save only the input and the shards, and "
           "gather the weight again in backward")
KEPT = ("after forward returned, a tensor it made, {} B = {} floats, is still alive: the size of layer 1's whole "
        "weight {}. ZeRO-3 frees the gathered weight when forward returns; something still holds it")
NEVER_ON = ("the parameter did not change, so no gradient reached this rank's shard: FSDP reduce-scatters only in a "
            "backward with gradient sync on")
NO_SCATTER = ("gradient sync stayed off, so nothing reached the shards; turn it back on "
              "(model.set_requires_gradient_sync(True)) before the last micro-batch's backward")
RECURSE = ("the Blocks still reduce-scatter every micro-batch: set_requires_gradient_sync(False, recurse=False) turns "
           "off only the root's own group")
RESET = ("every rank's shard of blocks.0.up.weight starts with the same values. reset_parameters() on a sharded model "
         "draws each rank's rows from the same random state")
FREQ = ("a buffer registered with persistent=False is in no state dict, so loading rank 0's leaves it as to_empty left "
        "it: memory without values")
NO_BROADCAST = (" raised at cell line 19: RuntimeError: The option indicates that model state_dict is required to save "
                "or load, but model state_dict is empty.rank = dist.get_rank()=",
                ".: only rank 0 is given the full state dict ({} on the others); "
                "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) makes rank 0 broadcast each tensor")

# A model sharded the wrong way still trains right when it trains (FSDP's groups change the communication, not the
# result): only the root sharded loses the structure's and the ledger's points, not the step's.
WRONG = [
    # The lesson's `for block in model.blocks`: this model's Blocks sit inside stages.
    pytest.param(SHARD, answers.SHARD_BLOCKS_ATTRIBUTE, {
        name: "raised at cell line 14: AttributeError: 'TiedModel' object has no attribute 'blocks'"
        for name in (UNITS_2, STEP_2, GATHERS_2, UNITS_4, STEP_4, GATHERS_4)}, id="shard-model-blocks"),
    # A group per stage: trains right, wrong groups and all-gathers.
    pytest.param(SHARD, answers.SHARD_PER_STAGE, {
        UNITS_2: "rank 0, case 1 of 1 (stages of 2, 1 Blocks, vocab 11, 2 rows per rank): the FSDP modules are ['', 'embed', 'stages.0', 'stages.1', 'head'], expected ['', 'embed', "
                 "'stages.0.0', 'stages.0.1', 'stages.1.0', 'head']: stages.0 is a Sequential of Blocks",
        GATHERS_2: "rank 0, case 1 of 1 (stages of 2, 1 Blocks, vocab 11, 2 rows per rank): the forward all-gathers 4 times",
        UNITS_4: ("rank 0, case 1 of 1 (stages of 1, 1, 2 Blocks, vocab 6, 1 row per rank): ", "stages.0 is a Sequential of Blocks"),
        GATHERS_4: "rank 0, case 1 of 1 (stages of 1, 1, 2 Blocks, vocab 6, 1 row per rank): the forward all-gathers 5 times",
    }, id="shard-per-stage"),
    pytest.param(SHARD, answers.SHARD_PAIR_IN_ROOT, {
        UNITS_2: ("rank 0, case 1 of 1 (stages of 2, 1 Blocks, vocab 11, 2 rows per rank): ", "embed and head are not: the tied pair stayed in the root's group"),
        GATHERS_2: "rank 0, case 1 of 1 (stages of 2, 1 Blocks, vocab 11, 2 rows per rank): the forward all-gathers 4 times (224 B = 56 floats,",
        UNITS_4: ("rank 0, case 1 of 1 (stages of 1, 1, 2 Blocks, vocab 6, 1 row per rank): ", "embed and head are not: the tied pair stayed in the root's group"),
        GATHERS_4: "rank 0, case 1 of 1 (stages of 1, 1, 2 Blocks, vocab 6, 1 row per rank): the forward all-gathers 5 times (80 B = 20 floats,",
    }, id="shard-tied-pair-in-root"),
    # torch refuses the pair at the first forward (the root's lazy init), not at the second call: the checker's
    # words say why and name the one call.
    pytest.param(SHARD, answers.SHARD_PAIR_APART, {
        name: ("Parameter 'head.weight' is shared with a parameter already managed by another FSDP group: embed and "
               "head hold one Parameter", "(torch finds that at the first forward). Shard the tied pair by one call, "
               "together")
        for name in (UNITS_2, STEP_2, GATHERS_2, UNITS_4, STEP_4, GATHERS_4)}, id="shard-tied-pair-apart"),
    pytest.param(SHARD, answers.SHARD_ROOT_FIRST, {
        name: (" raised at cell line 16: " + ROOT_FIRST,)
        for name in (UNITS_2, STEP_2, GATHERS_2, UNITS_4, STEP_4, GATHERS_4)}, id="shard-root-first"),
    # A Function that only gathers, under F.linear: the right numbers, but the whole weight kept for backward.
    pytest.param(ZERO3, answers.ZERO3_NO_FREE, {
        FREED_2: LINEAR_2 + NO_FREE.format([6, 8], 192, 48, [8, 6]),
        FREED_4: LINEAR_4 + NO_FREE.format([5, 12], 240, 60, [12, 5]),
    }, id="zero3-gathered-weight-kept-for-backward"),
    # The gathered weight put on ctx as an attribute (saved-tensor hooks never see it), an unused all-gather in
    # backward: the right numbers and collectives, but the whole weight alive from forward to backward.
    pytest.param(ZERO3, answers.ZERO3_KEPT_ON_CTX, {
        FREED_2: LINEAR_2 + KEPT.format(192, 48, [8, 6]),
        FREED_4: LINEAR_4 + KEPT.format(240, 60, [12, 5]),
    }, id="zero3-gathered-weight-kept-on-ctx"),
    pytest.param(ZERO3, answers.ZERO3_SUM, {
        VALUES_2: LINEAR_2 + "the gradient of layer 1's weight shard (rows 0 to 3 of 8) element [0, 0] is 0.278295, "
                             "expected 0.139148: that is 2 times the average, the sum over the ranks; average it",
        STEPS_2: LINEAR_2 + "after 3 SGD steps the shard of layer 1's weight (rows 0 to 3 of 8) element [0, 0] is "
                            "0.137757, expected 0.1648",
        VALUES_4: (LINEAR_4, "that is 4 times the average, the sum over the ranks; average it"),
        STEPS_4: (LINEAR_4, "after 3 SGD steps the shard of layer 1's weight (rows 0 to 2 of 12)"),
    }, id="zero3-sum-not-averaged"),
    # All-reduce the whole gradient, then keep this rank's rows: the right numbers, twice the traffic.
    pytest.param(ZERO3, answers.ZERO3_ALL_REDUCE, {
        SCATTERED_2: LINEAR_2 + ALL_REDUCE.format(128, 32),
        SCATTERED_4: LINEAR_4 + ALL_REDUCE.format(192, 48),
    }, id="zero3-all-reduce-then-slice"),
    # The lesson's recipe: the reduce-scatters saved, the all-gathers not.
    pytest.param(ACCUMULATE, answers.ACCUMULATE_SYNC_ONLY, {
        ACC_GATHER_2: (MICRO_2, "all-gathers 5 in micro-batch 1, 5 in micro-batch 2, 5 in micro-batch 3: every "
                                "micro-batch gathers again, as with gradient sync off alone"),
        ACC_GATHER_4: (MICRO_4, "all-gathers 7 in micro-batch 1, 7 in micro-batch 2: every micro-batch gathers again"),
    }, id="accumulate-lessons-recipe"),
    pytest.param(ACCUMULATE, answers.ACCUMULATE_NO_FORWARD, {
        ACC_GATHER_2: (MICRO_2, "all-gathers 5 in micro-batch 1, 2 in micro-batch 2, 2 in micro-batch 3: the Blocks "
                                "are gathered again in every backward: they are resharded after each forward"),
        ACC_GATHER_4: (MICRO_4, "they are resharded after each forward"),
    }, id="accumulate-resharded-after-forward"),
    pytest.param(ACCUMULATE, answers.ACCUMULATE_NO_BACKWARD, {
        ACC_GATHER_2: (MICRO_2, "all-gathers 3 in micro-batch 1, 3 in micro-batch 2, 3 in micro-batch 3: each later "
                                "forward gathers again: the groups were resharded after the backward before it"),
        ACC_GATHER_4: (MICRO_4, "the groups were resharded after the backward before it"),
    }, id="accumulate-resharded-after-backward"),
    pytest.param(ACCUMULATE, answers.ACCUMULATE_LEFT_GATHERED, {
        ACC_STEP_2: (MICRO_2, "is still the whole gathered tensor, as before the step"),
        ACC_SHARDED_2: (MICRO_2, "blocks.0.up.weight is still gathered (a whole tensor, not a DTensor) when your "
                                 "function returns"),
        ACC_STEP_4: (MICRO_4, "is still the whole gathered tensor, as before the step"),
    }, id="accumulate-left-gathered"),
    pytest.param(ACCUMULATE, answers.ACCUMULATE_NEVER_ON, {
        ACC_STEP_2: (MICRO_2, NEVER_ON), ACC_SYNC_2: (MICRO_2, NO_SCATTER),
        ACC_STEP_4: (MICRO_4, NEVER_ON), ACC_SYNC_4: (MICRO_4, NO_SCATTER),
    }, id="accumulate-sync-never-back-on"),
    pytest.param(ACCUMULATE, answers.ACCUMULATE_GRADS_KEPT, {
        ACC_STEP_2: (MICRO_2, "after the step blocks.0.up.weight.grad still holds the gradient"),
        ACC_STEP_4: (MICRO_4, "the statement asks for the gradients zeroed after the step"),
    }, id="accumulate-grads-kept"),
    pytest.param(ACCUMULATE, answers.ACCUMULATE_NOT_DIVIDED, {
        ACC_STEP_2: (MICRO_2, "the update is 3 times too large: divide each micro-batch's loss by K=3"),
        ACC_STEP_4: (MICRO_4, "the update is 2 times too large: divide each micro-batch's loss by K=2"),
    }, id="accumulate-loss-not-divided"),
    pytest.param(META, answers.META_WITH_TORCH, {
        name: "raised at cell line 19: RuntimeError: set_model_state_dict is what this exercise asks you to build"
        for name in (META_BUILT_2, META_VALUES_2, META_BUFFERS_2, META_BUILT_4, META_VALUES_4, META_BUFFERS_4)},
        id="meta-set-model-state-dict-refused"),
    pytest.param(META, answers.META_NO_FREQ, {
        META_BUFFERS_2: ("rank 0, case 1 of 1 (BufferedModel with 2 Blocks): scale.freq element 0 is ", FREQ),
        META_BUFFERS_4: ("rank 0, case 1 of 1 (BufferedModel with 3 Blocks): scale.freq element 0 is ", FREQ),
    }, id="meta-computed-buffer-left-empty"),
    pytest.param(META, answers.META_PARAMETERS_ONLY, {
        META_BUFFERS_2: ("rank 0, case 1 of 1 (BufferedModel with 2 Blocks): scale.shift element 0 is ",
                         "expected 0.144601: it is in rank 0's state dict; load it with the parameters"),
        META_BUFFERS_4: ("scale.shift element 0 is ", "it is in rank 0's state dict; load it with the parameters"),
    }, id="meta-buffers-not-loaded"),
    pytest.param(META, answers.META_RESET, {
        META_VALUES_2: "rank 0, case 1 of 1 (BufferedModel with 2 Blocks): its shard of blocks.0.up.weight (rows 0 to 6 "
                       "of 13) element [0, 0] is -0.258145, expected -0.0979284: " + RESET,
        META_VALUES_4: "rank 0, case 1 of 1 (BufferedModel with 3 Blocks): its shard of blocks.0.up.weight (rows 0 to 3 "
                       "of 13) element [0, 0] is 0.102497, expected -0.0233148: " + RESET,
        META_BUFFERS_2: FREQ, META_BUFFERS_4: FREQ,
    }, id="meta-reset-parameters"),
    pytest.param(META, answers.META_ON_CPU, {
        META_BUILT_2: "rank 0, case 1 of 1 (BufferedModel with 2 Blocks): build() made the parameters on the cpu "
                      "device, so every rank held and initialised the whole model; call it inside "
                      "`with torch.device('meta'):`",
        META_BUILT_4: "rank 0, case 1 of 1 (BufferedModel with 3 Blocks): build() made the parameters on the cpu device",
    }, id="meta-built-on-cpu"),
    pytest.param(HSDP, answers.HSDP_NAMES_SWAPPED, {
        HSDP_PLACED: HSDP_CASE + ": blocks.0.up.weight is Replicate() over the dim you named 'shard' (dim 0) and "
                                 "Shard(dim=0) over 'replicate' (dim 1): fully_shard on a 2-D mesh replicates over "
                                 "dim 0 and shards over dim 1",
    }, id="hsdp-dim-names-swapped"),
    # A 1-D mesh of every rank: FSDP over 4 ranks, nothing replicated (the numbers are right).
    pytest.param(HSDP, answers.HSDP_ONE_DIM, {
        HSDP_PLACED: HSDP_CASE + ": the mesh is 1-D, shape (4,): every parameter is sharded over all its 4 ranks, "
                                 "which is FSDP, not HSDP",
        HSDP_LEDGER: HSDP_CASE + ", the last training step: the ledger shows 5 all-gathers in ranks 0,1,2,3, 3 "
                                 "reduce-scatters in ranks 0,1,2,3, expected 5 all-gathers in ranks 0,1, 3 all-reduces "
                                 "in ranks 0,2, 3 reduce-scatters in ranks 0,1: every collective runs over all 4 ranks",
    }, id="hsdp-one-dim-mesh-of-4"),
]


# The rank a message must start with, where it is not rank 0: one of those that raised.
NAMED = {answers.SHARD_ROOT_FIRST: r"rank [0-3] raised", answers.SHARD_PAIR_APART: r"rank [0-3] raised",
         answers.SHARD_BLOCKS_ATTRIBUTE: r"rank [0-3] raised", answers.META_WITH_TORCH: r"rank [0-3] raised"}


@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    # A tuple of phrases: words around a rank number that depends on which of several failing ranks ended first.
    got = assert_loses_exactly(exercise_id, source, lost, ranks=ranks)
    for message in got.values():
        assert re.match(NAMED.get(source, r"rank 0[,: ]"), message), message


HANGS = [
    # The first tensor's broadcast on rank 0 only: the others never call it.
    pytest.param(META, answers.META_LOAD_ON_RANK_0, [
        "rank 0 is still in your function: it is waiting in broadcast #1 (416 B, world group)",
        "rank 1 finished your function and waits in the checker's all_gather_single (world group)"],
        id="load-on-rank-0-only"),
]


@pytest.mark.parametrize("exercise_id, source, phrases", HANGS)
def test_an_answer_that_hangs_is_stopped_at_its_deadline_naming_the_rank_and_collective(
        exercise_id, source, phrases, ranks):
    assert_hang_is_named(exercise_id, source, phrases, ranks, HANG_S)


def test_fully_shards_calls_are_the_ones_allowed():
    """The names FSDP2's collectives are recorded under (vocabulary) are allowed by every exercise that runs it."""
    for exercise_id in IDS:
        allowed = {canonical_op(op) for op in exercise(exercise_id).allowed_ops}
        assert {canonical_op(op) for op in FSDP2_OPS} <= allowed, exercise_id
    assert {canonical_op(op) for op in FSDP2_OPS} == {"all_gather_single", "reduce_scatter_single"}
