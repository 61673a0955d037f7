"""launch/train.py through launch/local.sh: DDP and FSDP2 on 2 CPU ranks equal one process."""

import pytest

from launch_helpers import LAUNCH, TRAIN, assert_matches, launch_env, reference, run_all

ARGS = ["--steps", "3"]


@pytest.fixture(scope="module")
def one_process():
    return reference(ARGS)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_train_on_two_ranks_equals_one_process(parallel, one_process):
    run = run_all([["bash", str(LAUNCH / "local.sh"), str(TRAIN), "--parallel", parallel, *ARGS]],
                  launch_env(NPROC="2"), timeout_s=240)
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    assert "[rank0]:[torchrun] 2 ranks, backend gloo on cpu" in run.text  # the backend, said first
    layout = {"ddp": "DDP on 2 ranks", "fsdp": "FSDP2 on 2 ranks"}[parallel]
    assert f"[rank0]:{layout}; global batch 8 = 2 x 4 rows" in run.text
    assert_matches(run, one_process, steps=[1, 2, 3])


def test_one_process_loss_falls(one_process):
    steps, final = one_process
    assert steps[3] < steps[1] and final == pytest.approx(steps[3], abs=1e-6)


def test_local_without_script_prints_usage():
    run = run_all([["bash", str(LAUNCH / "local.sh")]], launch_env(), timeout_s=30)
    assert run.returncodes == [2] and run.outputs[0].startswith("usage:"), run.explain()
