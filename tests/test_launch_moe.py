"""launch/train.py --moe-experts 4 --ep 2 (a tiny Mixtral, expert parallelism by hand) on 4 CPU ranks, equal to one
process: the loss at every step, and the model and Adam's state after the last step, read back from the run's DCP
checkpoint in this process. The layout is ep=2 x dp_mod_ep=2: two experts per rank, each FSDP2-sharded over the
2 ranks holding it, everything else over all 4. (ep=4, one expert per rank, passed the same test by hand; it is
left out to keep the suite short.) An expert count that does not divide is one line before any rank starts.

Why Adam's state too: Adam's update hardly changes when a gradient is scaled by a constant, so experts' gradients
ep times too large (summed over the ep ranks' tokens, then averaged over dp_mod_ep only) moved the step-2 loss by
2e-6 only, at the limit of what the printed losses show; Adam's first moment was then 2x one process's (checked
by hand). Both launches at once (the bad one's 2 ranks stop while parsing their flags).
"""

import copy
import warnings

import pytest
import torch

from launch_helpers import LAUNCH, TRAIN, assert_matches, launch_env, load_train, reference, run_all

ARGS = ["--moe-experts", "4", "--steps", "3"]
LAUNCHES = {  # name -> (ranks, flags)
    "ep2": (4, ["--parallel", "fsdp", "--ep", "2", *ARGS]),
    "bad_experts": (2, ["--parallel", "fsdp", "--moe-experts", "3", "--ep", "2", "--steps", "3"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both launches at once; each EP run saves a DCP checkpoint after its last step."""
    root = tmp_path_factory.mktemp("moe")
    commands = [["env", f"NPROC={ranks}", "bash", str(LAUNCH / "local.sh"), str(TRAIN), *flags,
                 "--ckpt-dir", str(root / name)] for name, (ranks, flags) in LAUNCHES.items()]
    run = run_all(commands, launch_env(OMP_NUM_THREADS="1"), timeout_s=400)
    assert not run.leftovers, run.leftovers
    return {name: (run.part(i), root / name) for i, name in enumerate(LAUNCHES)}


@pytest.fixture(scope="module")
def one_process():
    """One process's losses, and its model and optimizer state after the last step."""
    keep = {}
    return reference(ARGS, keep), keep["app"].state_dict()


def load_checkpoint(path, like: dict) -> dict:
    """The checkpoint at `path` read into a copy of `like` (one process's state dict), every float made NaN first."""
    import torch.distributed.checkpoint as dcp

    got = copy.deepcopy(like)
    for part in ("model", "optim"):
        for value in got[part].values():
            if torch.is_tensor(value) and value.is_floating_point():
                value.fill_(float("nan"))  # a tensor the checkpoint lacked cannot pass for one process's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load({"app": got}, checkpoint_id=path)
    return got


@pytest.mark.slow
def test_ep_x_fsdp_equals_one_process(runs, one_process):
    name, layout = "ep2", ("EP x FSDP2 (ep=2, experts FSDP2 over 2, the rest over 4) on 4 ranks; global batch 8 = "
                           "4 x 2 rows; 4 experts per layer, top-2, 2 per ep rank, all-to-all")
    run, ckpt = runs[name]
    ref_losses, want = one_process
    assert run.returncodes == [0], run.explain()
    assert f"[rank0]:{layout}" in run.text, run.explain()
    assert_matches(run, ref_losses, steps=[1, 2, 3])
    got = load_checkpoint(ckpt / "step_000003", want)
    assert got["step"] == 3
    # Every parameter under its global name (each expert once), and Adam's moments of each: equal to one
    # process's within float rounding, which Adam amplifies in entries whose gradient is near 0 (1.5e-4 of the
    # tensor's largest entry measured; an expert gradient ep times too large: 2e-2 in the weights, 1.0 in exp_avg).
    for part in ("model", "optim"):
        for key, value in want[part].items():
            if torch.is_tensor(value):
                torch.testing.assert_close(got[part][key], value, rtol=0, atol=1e-3 * value.abs().max().item(),
                                           msg=lambda m, key=key: f"{name}: {part} {key}: {m}")
            else:
                assert got[part][key] == value, (part, key)


@pytest.mark.slow
def test_experts_not_dividing_is_one_line_before_any_rank_starts(runs):
    run, _ = runs["bad_experts"]
    # local.sh asks train.py --check-only first: one line, exit 2, torchrun never started
    assert run.returncodes == [2], run.explain()
    assert run.text.splitlines() == ["train.py: error: --moe-experts 3 does not divide among --ep 2 ranks "
                                     "(each holds the same number of experts)"], run.text


@pytest.mark.parametrize("flags, world, problem", [
    ("--parallel fsdp --moe-experts 4 --ep 4", 4, None),
    ("--parallel fsdp --moe-experts 4 --ep 2", 4, None),
    ("--parallel fsdp --moe-experts 4", 4, None),  # experts without EP: plain FSDP2 shards them like the rest
    ("--parallel ddp --moe-experts 4", 2, None),
    ("--parallel fsdp --moe-experts 6 --ep 4", 4, "--moe-experts 6 does not divide among --ep 4 ranks"),
    ("--parallel fsdp --moe-experts 6 --ep 3", 4, "--ep 3 does not divide the world size 4"),
    ("--parallel fsdp --ep 2", 4, "--ep 2 needs --moe-experts"),
    ("--parallel ddp --moe-experts 4 --ep 2", 4, "--ep 2 needs --parallel fsdp"),
    ("--parallel 2d --tp 2 --moe-experts 4", 4, "--moe-experts 4 needs --parallel fsdp or ddp"),
    ("--parallel fsdp --moe-experts 4 --ep 2 --pp 2", 4, "--moe-experts 4 with --pp or --cp: not supported here"),
    ("--parallel fsdp --moe-experts 4 --ep 2 --cp 2", 4, "--moe-experts 4 with --pp or --cp: not supported here"),
    ("--parallel fsdp --moe-experts 1", 4, "--moe-experts 1: at least 2"),
    ("--parallel fsdp --moe-experts 4 --ep 0", 4, "--ep 0: must be at least 1"),
])
def test_moe_layout_problem(flags, world, problem, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    train = load_train()
    args = train.parse_args(flags.split())  # no RANK here: parse_args checks nothing, layout_problem does
    found = train.layout_problem(args, world)
    assert (found is None) if problem is None else (found or "").startswith(problem), found
