"""Two torchrun agents on 127.0.0.1 as two nodes (c10d rendezvous, 2 ranks each) run train.py 2-D = one process."""

import pytest

from launch_helpers import LAUNCH, TRAIN, assert_matches, free_port, launch_env, reference, run_all

ARGS = ["--parallel", "2d", "--tp", "2", "--steps", "3"]


@pytest.mark.slow
def test_two_nodes_on_loopback_equal_one_process():
    env = launch_env(NNODES="2", NPROC="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID="loopback",
                     MAX_RESTARTS="0", GLOO_SOCKET_IFNAME="lo")
    node = ["bash", str(LAUNCH / "multinode.sh"), str(TRAIN), *ARGS]
    run = run_all([node, node], env, timeout_s=300)
    assert run.returncodes == [0, 0], run.explain()
    assert not run.leftovers, run.leftovers
    assert "[rank0]:[torchrun] 4 ranks, backend gloo on cpu" in run.text
    assert "[rank0]:FSDP2 x TP (dp=2, tp=2) on 4 ranks; global batch 8 = 2 x 4 rows" in run.text
    # Only global rank 0 prints the losses: one node shows them, the other none.
    assert sorted("final loss" in out for out in run.outputs) == [False, True], run.explain()
    assert_matches(run, reference(ARGS), steps=[1, 2, 3])
