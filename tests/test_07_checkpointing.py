"""Lesson 07 (distributed checkpointing): its exercises graded on real gloo ranks, and the crash it teaches.

The solution scores full marks, the stub zero with its hint (shown once per report), and each plausible wrong
answer loses exactly the points its mistake deserves, with a message that names the rank and what is wrong.
One set of grading ranks serves the whole module (as the grader gives one to a submission), forked from a
server that has imported FSDP2 and DCP.

`test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable`: the lesson's section 8 outside the
notebook: torchrun, 2 ranks, rank 1 SIGKILLed in the middle of a save; the previous checkpoint loads in one
process and equals it, the interrupted one has no `.metadata` and refuses to load.
"""

from __future__ import annotations

import os
import re
import warnings

import nbformat
import pytest
import torch

import grading_answers_07 as answers
from exercise_checks import (shared_ranks, assert_full_marks, assert_hang_is_named, assert_loses_exactly,
                             assert_section_states_the_check, assert_stub_scores_zero_with_its_first_hint_once)
from exercise_notebooks import assert_lists_exactly, exercise_sections, notebook_path
from proc_helpers import launch, startup_deadline_s
from course_lib.grading.cells import exercise_cells
from course_lib.grading.registry import exercise, exercises_of_lesson

NOTEBOOK = "07_checkpointing.ipynb"
SOLUTIONS = exercise_cells(nbformat.read(notebook_path("solutions", NOTEBOOK), as_version=4))
STUBS = exercise_cells(nbformat.read(notebook_path("exercises", NOTEBOOK), as_version=4))
IDS = exercises_of_lesson("07")
APP, RESHARD, CRASH = IDS


ranks = shared_ranks(IDS)


@pytest.mark.parametrize("notebook", ["solutions", "exercises"])
def test_the_notebook_lists_exactly_the_exercises_graded(notebook):
    assert IDS == ["07.app_state", "07.reshard_load", "07.crash_safe_save"]
    assert_lists_exactly(notebook, NOTEBOOK, IDS)


@pytest.mark.parametrize("exercise_id", IDS)
def test_each_exercise_states_its_deadline_cases_and_allowed_calls(exercise_id):
    assert_section_states_the_check(exercise_id, exercise_sections("solutions", NOTEBOOK)[exercise_id])
    points = [item.points for run in exercise(exercise_id).runs for item in run.items]
    assert sum(points) == exercise(exercise_id).points


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_scores_full_marks(exercise_id, ranks):
    assert_full_marks(exercise_id, SOLUTIONS[exercise_id], ranks=ranks)


@pytest.mark.slow
def test_every_rank_replacing_latest_through_its_own_temporary_file_scores_full_marks(ranks):
    # Two ranks' os.replace each save: on ext4 the freed inode of one is reused by the next, so LATEST after a
    # save can carry the previous save's inode number although it was replaced, never rewritten.
    assert_full_marks(CRASH, answers.CRASH_EVERY_RANK_REPLACES, ranks=ranks)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_scores_zero_and_says_what_to_write_once(exercise_id, ranks):
    assert_stub_scores_zero_with_its_first_hint_once(exercise_id, STUBS[exercise_id], ranks=ranks)


RESUMED = ("a new run loaded from the checkpoint reproduces the uninterrupted losses and rank 0's EMA, bit for bit "
           "(2 ranks)")
RESHARD_PARAMS_2 = "one process -> FSDP2: the parameters equal one process after 2 steps (2 ranks)"
RESHARD_OPTIM_2 = "one process -> FSDP2: Adam's moments, step counts and lr equal one process's (2 ranks)"
RESHARD_PIECES_2 = ("one process -> FSDP2: rank 1 reads nothing on rank 0's disk and never receives half the "
                    "checkpoint or more at once (2 ranks)")
RESHARD_PARAMS_4 = "one process -> HSDP (2, 2): the parameters equal one process after 2 steps (4 ranks)"
RESHARD_OPTIM_4 = "one process -> HSDP (2, 2): Adam's moments, step counts and lr equal one process's (4 ranks)"
OWN_FOLDER = "after each save, LATEST names a checkpoint of its own and was replaced in one step (2 ranks)"
KEEPS = "after each good save, root holds exactly the newest 2 complete checkpoints (2 ranks)"
SURVIVES = ("a save that fails part-way deletes nothing and leaves LATEST naming step 10's checkpoint, which loads and "
            "equals one process (2 ranks)")

WRONG = [
    # Adam's state left out: step k+1's forward still uses the loaded weights, step k+2 differs.
    pytest.param(APP, answers.APP_NO_OPTIMIZER, {
        RESUMED: ("resumed at step 3, the loss of step 5 is", "not restored by the load: Adam's state"),
    }, id="app-state-without-optimizer"),
    # One name for a state that differs per rank: one rank's copy comes back to every rank.
    pytest.param(APP, answers.APP_GENERATOR_ONE_NAME, {
        RESUMED: ("run.generator holds rank", "saved state: saved under one name shared by the ranks",
                  "save it under a name per rank"),
    }, id="app-state-generator-under-one-name"),
    # The lesson's torch.get_rng_state(): the global RNG is not the run's generator.
    pytest.param(APP, answers.APP_GLOBAL_RNG, {
        RESUMED: ("run.generator is the new run's own while the global RNG was restored",
                  "torch.get_rng_state() does not hold"),
    }, id="app-state-global-rng-instead-of-generator"),
    pytest.param(APP, answers.APP_GENERATOR_NOT_SET, {
        RESUMED: ("run.generator is the new run's own: its state was not saved, or not set back with set_state",),
    }, id="app-state-generator-not-set-back"),
    pytest.param(APP, answers.APP_NO_EMA, {
        RESUMED: ("rank 0,", "run.ema is still None after the load", "rank 0's EMA was not saved"),
    }, id="app-state-without-ema"),
    pytest.param(APP, answers.APP_EMA_FROM_WEIGHTS, {
        RESUMED: ("rank 0,", "run.ema equals the loaded weights: an EMA rebuilt from the weights forgets",),
    }, id="app-state-ema-rebuilt-from-weights"),
    # The lesson's way, the EMA under one name on every rank (None on rank 1): the new launch's rank 0 has
    # nothing for dcp.load to fill.
    pytest.param(APP, answers.APP_EMA_AS_IS, {
        RESUMED: ("rank 0,", "run.ema is still None after the load, although the checkpoint holds the shadows",
                  "rank 0 handed dcp.load no tensors of the EMA's to fill"),
    }, id="app-state-ema-under-one-name-on-every-rank"),
    # Saved on rank 0 alone, but nothing to fill in the new launch: DCP's planner names the missing entry.
    pytest.param(APP, answers.APP_EMA_NOTHING_TO_FILL, {
        RESUMED: ("rank 0,", "dcp.load raised", "Missing key in checkpoint state_dict: app.ema",
                  "an entry the saved run's did not"),
    }, id="app-state-ema-nothing-to-fill"),
    pytest.param(APP, answers.APP_EMA_DTENSOR_BUFFERS, {
        RESUMED: ("rank 0,", "run.ema holds DTensors after the load"),
    }, id="app-state-ema-dtensor-buffers"),
    # Rank 1 saves zeros under the EMA's names: DCP takes them for replicas and writes some of rank 1's.
    pytest.param(APP, answers.APP_EMA_PLACEHOLDER, {
        RESUMED: ("rank 0,", "holds values rank 0 never saved: rank 1 wrote whole tensors", "another rank saved a tensor under the same name",
                  "names no other rank saves"),
    }, id="app-state-ema-placeholder-on-other-ranks"),
    # Every rank of the new launch loads the EMA and keeps it: rank 1 holds what it must not need.
    pytest.param(APP, answers.APP_EMA_LOADED_EVERYWHERE, {
        RESUMED: ("rank 1,", "run.ema is no longer None after the load: only rank 0 keeps the EMA"),
    }, id="app-state-ema-loaded-on-every-rank"),
    pytest.param(APP, answers.APP_NO_SET_STATE_DICT, {
        RESUMED: ("resumed at step 3, the loss of step", "Adam's param_groups (its lr"),
    }, id="app-state-without-set-state-dict"),
    pytest.param(APP, answers.APP_NO_STEP, {
        RESUMED: ("the resumed run starts at step 0, expected 3: run.step was not restored",),
    }, id="app-state-without-step"),
    # set_model_state_dict alone (lesson 05's call): Adam keeps the fresh run's state.
    pytest.param(RESHARD, answers.RESHARD_MODEL_ONLY, {
        RESHARD_OPTIM_2: ("loaded on 2 ranks over a mesh of 2 (FSDP2)", "the optimizer's state was not loaded"),
        RESHARD_OPTIM_4: ("loaded on 4 ranks over a (2, 2) mesh (HSDP", "the optimizer's state was not loaded"),
    }, id="reshard-model-only"),
    # The whole file broadcast as one object: every rank holds all of it, what the exercise rules out.
    pytest.param(RESHARD, answers.RESHARD_BROADCAST_WHOLE, {
        RESHARD_PIECES_2: ("rank 1, loaded on 2 ranks over a mesh of 2 (FSDP2): it received",
                           "in one object from an object collective", "it held the whole state at once"),
    }, id="reshard-whole-file-broadcast-to-every-rank"),
    # Every rank torch.loads the file by the name rank 0 broadcast: it lies on rank 0's disk only.
    pytest.param(RESHARD, answers.RESHARD_EVERY_RANK_READS, {
        RESHARD_PIECES_2: ("rank 1, loaded on 2 ranks over a mesh of 2 (FSDP2): it opened 'one_process.pt', the "
                           "checkpoint file, which lies on rank 0's disk only",),
    }, id="reshard-every-rank-reads-the-file"),
    # Section 9's route: rank 0 converts to a DCP folder on its own disk, which the other ranks cannot read.
    pytest.param(RESHARD, answers.RESHARD_CONVERTED_BY_RANK0, {
        RESHARD_PIECES_2: ("rank 1, loaded on 2 ranks over a mesh of 2 (FSDP2): it read ['converted/.metadata'",
                           "which rank 0 wrote on its own disk", "torch_save_to_dcp"),
    }, id="reshard-rank-0-converts-to-dcp-on-its-own-disk"),
    pytest.param(CRASH, answers.CRASH_IN_PLACE, {
        OWN_FOLDER: ("after the save of step 9, LATEST is the same file as after the save before, rewritten in place",
                     "os.replace"),
    }, id="crash-latest-rewritten-in-place"),
    pytest.param(CRASH, answers.CRASH_OVERWRITE, {
        OWN_FOLDER: ("went to ['step_0', 'step_0', 'step_0', 'step_0']",),
        SURVIVES: ("it holds step 11's values, written over the checkpoint of step 10 by the save that failed",),
    }, id="crash-one-folder-overwritten"),
    # Written before the save, and in place (no os.replace): it loses both.
    pytest.param(CRASH, answers.CRASH_MARK_FIRST, {
        OWN_FOLDER: ("rewritten in place",),
        SURVIVES: ("LATEST names 'step_11', not step 10's 'step_10'", "loading it fails (CheckpointException"),
    }, id="crash-marked-before-the-save"),
    pytest.param(CRASH, answers.CRASH_SWALLOWS, {
        SURVIVES: ("but save_checkpoint returned normally",),
    }, id="crash-error-swallowed"),
    # Newest by name: 'step_10' < 'step_8' as text, so step_8 stays beside the two newest.
    pytest.param(CRASH, answers.CRASH_SORTED_BY_NAME, {
        KEEPS: ("after the save of step 10 (keep=2), root holds ['step_10', 'step_8', 'step_9']",
                "['step_8'] should have been deleted"),
    }, id="crash-newest-by-name"),
    pytest.param(CRASH, answers.CRASH_COUNTS_INCOMPLETE, {
        KEEPS: ("after the save of step 12", "['step_11'] has no .metadata (the failed save's) and was counted",
                "so ['step_10'] was deleted"),
    }, id="crash-incomplete-folder-counted"),
    # LATEST names the folder with root in front: nothing under root has that name; the pruning is right.
    pytest.param(CRASH, answers.CRASH_LATEST_WITH_ROOT, {
        OWN_FOLDER: ("after the save of step 8, LATEST holds 'checkpoints/step_8', and checkpoints/checkpoints/step_8 "
                     "is no folder", "relative to root", "('step_8', not the path you passed to dcp.save)"),
        SURVIVES: ("after the failed save, a restart finds no checkpoint: LATEST holds 'checkpoints/step_10'",),
    }, id="crash-latest-holds-the-root-too"),
    pytest.param(CRASH, answers.CRASH_PRUNE_FIRST, {
        SURVIVES: ("after the failed save of step 11, ['step_9']",
                   "a save may delete old checkpoints only once it is complete itself"),
    }, id="crash-deletes-before-the-save"),
]


@pytest.mark.slow
@pytest.mark.parametrize("exercise_id, source, lost", WRONG)
def test_wrong_answer_loses_the_right_points_and_says_why(exercise_id, source, lost, ranks):
    got = assert_loses_exactly(exercise_id, source, lost, ranks=ranks)
    for message in got.values():
        assert re.match(r"rank \d[,: ]", message), message


@pytest.mark.slow
def test_whole_tensors_without_broadcast_from_rank0_fail_on_a_rank_without_the_file(ranks):
    # full_state_dict=True alone: every rank must hold the whole dicts; the ranks without the file have none and
    # torch says so (on 4 ranks, whichever of ranks 1-3 raises first is named).
    lost = {name: (" raised at cell line", "optim state_dict is empty")
            for name in (RESHARD_PARAMS_2, RESHARD_OPTIM_2, RESHARD_PIECES_2, RESHARD_PARAMS_4, RESHARD_OPTIM_4)}
    got = assert_loses_exactly(RESHARD, answers.RESHARD_NO_BROADCAST, lost, ranks=ranks)
    for message in got.values():
        assert re.match(r"rank [1-3] raised", message), message


@pytest.mark.slow
@pytest.mark.parametrize("source, phrases", [
    # {} for the model on rank 1: set_state_dict loads the optimizer only there, rank 0 waits in the model's
    # broadcasts.
    pytest.param(answers.RESHARD_EMPTY_MODEL_DICT, ["rank 0 is still in your function: it is waiting in "
                                                    "broadcast_object_list", "rank 1 finished your function"],
                 id="reshard-empty-model-dict-on-the-other-ranks"),
    # Rank 0 alone loads: its scatter of each whole tensor waits for ranks that returned.
    pytest.param(answers.RESHARD_RANK0_ALONE, ["rank 0 is still in your function",
                                               "rank 1 finished your function and waits in the checker's barrier"],
                 id="reshard-rank-0-alone"),
])
def test_a_load_that_leaves_rank_0_alone_is_stopped_and_named(source, phrases, ranks):
    assert_hang_is_named(RESHARD, source, phrases, ranks, hang_s=10)


KILLED_SAVE = """
import os
import signal
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from course_lib.models import make_batch, make_model


class DiesAfterWriting(FileSystemWriter):
    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return written


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = make_model()
for block in (model[1], model[2]):
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
inputs, targets = make_batch()
rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
for step in (1, 2):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    writer = DiesAfterWriting("step_2") if step == 2 else None
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"step_{step}", storage_writer=writer)
    print(f"saved step {step}", flush=True)
"""


@pytest.mark.slow  # one torchrun of 2 ranks importing FSDP2 and DCP: 20-70 s on the shared 2-core machine
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from course_lib.models import make_batch, make_model

    result = launch(KILLED_SAVE, 2, timeout_s=4 * startup_deadline_s(2) + 30, cwd=str(tmp_path)).result
    assert not result.timed_out, "a rank killed in the middle of dcp.save hung the job"
    assert result.exit_codes.get(1) == -9, result.exit_codes  # rank 1 died by SIGKILL
    assert sorted(os.listdir(tmp_path / "step_1")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert ".metadata" not in os.listdir(tmp_path / "step_2")  # written last: the interrupted save has none

    # One process: the model after step 1, as the checkpoint should hold it.
    model, (inputs, targets) = make_model(), make_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process, on purpose
        loaded = {"model": make_model().state_dict()}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "step_1"))
        for name, value in model.state_dict().items():
            torch.testing.assert_close(loaded["model"][name], value)
        with pytest.raises(CheckpointException):
            dcp.load({"model": make_model().state_dict()}, checkpoint_id=str(tmp_path / "step_2"))
