"""launch/train.py --cp 2 (context parallelism, ring attention by hand) on 4 CPU ranks, equal to one process at
every step: CP x FSDP2 (dp=2, cp=2) and CP x TP (cp=2, tp=2); a --seq that does not divide is one line; the ring
attention itself against SDPA (output and q/k/v gradients) on 3 ranks, so that blocks make more than one hop.

One launch of all four at once (10 ranks that mostly wait for each other's start-up): one launch's time.
Run under torchrun, this file is the ring-attention check itself (`ring_check`).
"""

import os
import sys

import pytest

from launch_helpers import LAUNCH, TRAIN, assert_matches, launch_env, load_train, reference, run_all

ARGS = ["--steps", "3", "--seq", "32"]  # 2 slices of 16 tokens
LAUNCHES = {  # name -> (ranks, flags)
    "cp_fsdp": (4, ["--parallel", "fsdp", "--cp", "2", *ARGS]),
    "cp_tp": (4, ["--parallel", "2d", "--tp", "2", "--cp", "2", *ARGS]),
    "bad_seq": (2, ["--parallel", "fsdp", "--cp", "2", "--steps", "3", "--seq", "15"]),
}


@pytest.fixture(scope="module")
def runs():
    commands = [["env", f"NPROC={ranks}", "bash", str(LAUNCH / "local.sh"), str(TRAIN), *flags]
                for ranks, flags in LAUNCHES.values()]
    commands.append([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                     "--tee", "3", "--role", "rank", __file__])
    run = run_all(commands, launch_env(OMP_NUM_THREADS="1"), timeout_s=400)
    assert not run.leftovers, run.leftovers
    return {name: run.part(i) for i, name in enumerate([*LAUNCHES, "ring_check"])}


@pytest.fixture(scope="module")
def one_process():
    return reference(ARGS)


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [
    ("cp_fsdp", "CP x FSDP2 (dp=2, cp=2) on 4 ranks; global batch 8 = 2 x 4 rows"),
    ("cp_tp", "CP x FSDP2 x TP (dp=1, cp=2, tp=2) on 4 ranks; global batch 8 = 1 x 8 rows"),
])
def test_cp_equals_one_process(runs, one_process, name, layout):
    run = runs[name]
    assert run.returncodes == [0], run.explain()
    assert f"[rank0]:{layout}; sequence 32 = 2 x 16 tokens, ring attention" in run.text, run.explain()
    assert_matches(run, one_process, steps=[1, 2, 3])


@pytest.mark.slow
def test_seq_not_dividing_is_one_line_before_any_rank_starts(runs):
    run = runs["bad_seq"]
    # local.sh asks train.py --check-only first: one line, exit 2, torchrun never started
    assert run.returncodes == [2], run.explain()
    assert run.text.splitlines() == ["train.py: error: --seq 15 does not divide into 2 equal slices (--cp 2)"], run.text


@pytest.mark.slow
def test_ring_attention_equals_sdpa_on_three_ranks(runs):
    run = runs["ring_check"]
    assert run.returncodes == [0], run.explain()
    assert sorted(ln for ln in run.text.splitlines() if "ring attention" in ln) == [
        f"[rank{r}]:ring attention = SDPA on rank {r}: output, q/k/v gradients" for r in range(3)], run.explain()


@pytest.mark.parametrize("flags, world, problem", [
    ("--parallel fsdp --cp 2", 4, None),
    ("--parallel 2d --tp 2 --cp 2", 4, None),
    ("--parallel 2d --tp 2 --cp 2", 8, None),
    ("--parallel fsdp --cp 2 --seq 15", 4, "--seq 15 does not divide into 2 equal slices (--cp 2)"),
    ("--parallel ddp --cp 2", 4, "--cp 2 needs --parallel fsdp or 2d"),
    ("--parallel fsdp --cp 2 --pp 2", 4, "--cp 2 with --pp 2: not supported here"),
    ("--parallel 2d --tp 2 --cp 2", 6, "--cp 2 x tp 2 = 4 does not divide the world size 6"),
    ("--parallel fsdp --cp 2 --dp 4", 4, "--pp 1 x --dp 4 x --cp 2 x tp 1 = 8 ranks, not the world size 4"),
    ("--parallel fsdp --cp 0", 4, "--cp 0: must be at least 1"),
    ("--parallel fsdp --cp 2 --batch 6", 8, "--batch 6 does not divide among 4 dp ranks"),
])
def test_cp_layout_problem(flags, world, problem, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    train = load_train()
    args = train.parse_args(flags.split())  # no RANK here: parse_args checks nothing, layout_problem does
    found = train.layout_problem(args, world)
    assert (found is None) if problem is None else (found or "").startswith(problem), found


def test_cp_layout_fills_dp(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    train = load_train()
    args = train.parse_args("--parallel 2d --tp 2 --cp 2".split())
    assert train.layout_problem(args, 8) is None and (args.dp, args.cp) == (2, 2)


def ring_check() -> None:
    """Under torchrun: causal attention over a sequence of 3 slices of 8, by ring attention and by SDPA on the
    whole sequence in every process; this rank's slice of the output and of q/k/v's gradients must agree."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(LAUNCH))
    from ring_attention import RingAttention

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same full tensors in every process
    q, k, v = (torch.randn(2, 4, 8 * size, 8, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 8 * size, 8)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    whole.backward(grad)
    mine = slice(8 * rank, 8 * (rank + 1))
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    out = RingAttention.apply(ql, kl, vl, 8 ** -0.5, dist.group.WORLD)
    out.backward(grad[:, :, mine])
    torch.testing.assert_close(out, whole[:, :, mine])
    for local, full in ((ql, q), (kl, k), (vl, v)):
        torch.testing.assert_close(local.grad, full.grad[:, :, mine])
    print(f"ring attention = SDPA on rank {rank}: output, q/k/v gradients", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and "RANK" in os.environ:
    ring_check()
