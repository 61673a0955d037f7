"""A worker SIGKILLed mid-run: torchrun (--max-restarts 1) restarts the group, which resumes from the
newest complete DCP checkpoint and ends at one process's final loss.

Gloo restarts as torch ships them fail or hang in some runs; train.py gives each attempt its own
store prefix. Before this test went in it passed 10 runs out of 10 (torch 2.13.0, 2 cores at load 13-24).
"""

import pytest

from launch_helpers import LAUNCH, TRAIN, assert_matches, launch_env, reference, run_all

ARGS = ["--parallel", "2d", "--tp", "2", "--steps", "4", "--ckpt-every", "2"]


def restart_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = ["bash", str(LAUNCH / "local.sh"), str(TRAIN), *ARGS, "--ckpt-dir", str(ckpt), "--crash-at-step", "4"]
    return run_all([cmd], launch_env(NPROC="2", MAX_RESTARTS="1"), timeout_s=300), ckpt


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_to_the_same_loss(tmp_path):
    run, ckpt = restart_run(tmp_path)
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    text = run.text
    # Attempt 0: steps 1-3, a checkpoint at step 2, then the last rank kills itself before step 4.
    assert "[rank1]:rank 1: --crash-at-step 4: SIGKILL to myself" in text, run.explain()
    assert "exitcode: -9" in text, run.explain()
    # Attempt 1 (torchrun's restart): the newest complete checkpoint is step 2, so steps 3 and 4 run again.
    assert "[rank0]:resumed from step_000002 (attempt 1): next step 3" in text, run.explain()
    assert text.count("[rank0]:step 3/4") == 2 and text.count("[rank0]:step 4/4") == 1, run.explain()
    assert_matches(run, reference(ARGS), steps=[1, 2, 3, 4])
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002", "step_000004"]
    assert all((p / "COMPLETE").exists() and (p / ".metadata").exists() for p in ckpt.iterdir())
