"""launch/train.py --pp 2 through local.sh: PP x FSDP2 on 4 CPU ranks equal to one process step by step; its
checkpoint resumed under FSDP2 without stages and under PP x TP, each equal to one process; the 3-D run
(pp x dp x tp = 2 x 2 x 2) on 8 ranks equal to one process; bad layouts are one line.

Three launches of 4 ranks for the first part: the first (PP x FSDP2, steps 1-2, a checkpoint at step 2) is
shared by the two resumes, which each run steps 3-4 from their own copy of its checkpoint.
"""

import shutil

import pytest

from launch_helpers import LAUNCH, TRAIN, assert_matches, launch_env, load_train, reference, run_all

PP_FSDP = ["--parallel", "fsdp", "--pp", "2"]
PP_TP = ["--parallel", "2d", "--tp", "2", "--pp", "2"]


def local4(args, *, timeout_s=300):
    return run_all([["bash", str(LAUNCH / "local.sh"), str(TRAIN), *map(str, args)]], launch_env(NPROC="4"),
                   timeout_s=timeout_s)


@pytest.fixture(scope="module")
def one_process():
    """One process's losses for 4 steps."""
    return reference(["--steps", "4"])


@pytest.fixture(scope="module")
def pp_fsdp(tmp_path_factory):
    """PP x FSDP2 (pp=2, dp=2), steps 1-2, saving a checkpoint after step 2."""
    ckpt = tmp_path_factory.mktemp("pp_fsdp") / "ckpt"
    return local4([*PP_FSDP, "--steps", "2", "--ckpt-dir", ckpt]), ckpt


def resume_from_copy(pp_fsdp, tmp_path, args):
    """Copy the PP x FSDP2 checkpoint (each resume writes its own step 4), resume to step 4 under `args`."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pp_fsdp[1], ckpt)
    return local4([*args, "--steps", "4", "--ckpt-dir", ckpt])


@pytest.mark.slow
def test_pp_x_fsdp_equals_one_process(pp_fsdp, one_process):
    run, ckpt = pp_fsdp
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    assert ("[rank0]:PP x FSDP2 (pp=2, dp=2) on 4 ranks; global batch 8 = 2 x 4 rows; "
            "Schedule1F1B, 2 microbatches of 2") in run.text, run.explain()
    assert_matches(run, reference(["--steps", "2"]), steps=[1, 2])
    # Each of the 4 ranks wrote its own shards of its own stage; rank 0 marked the folder complete.
    assert sorted(p.name for p in (ckpt / "step_000002").iterdir()) == [
        ".metadata", "COMPLETE", *(f"__{r}_0.distcp" for r in range(4))]


@pytest.mark.slow
def test_pp_checkpoint_resumes_under_fsdp_without_stages(pp_fsdp, one_process, tmp_path):
    # Stages keep the whole model's parameter names, so FSDP2 over 4 ranks finds every one of them.
    run = resume_from_copy(pp_fsdp, tmp_path, ["--parallel", "fsdp"])
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    assert "[rank0]:resumed from step_000002 (attempt 0): next step 3" in run.text, run.explain()
    assert "[rank0]:FSDP2 on 4 ranks; global batch 8 = 4 x 2 rows" in run.text, run.explain()
    assert_matches(run, one_process, steps=[3, 4])


@pytest.mark.slow
def test_pp_checkpoint_resumes_under_pp_x_tp(pp_fsdp, one_process, tmp_path):
    # The same stages, now split by TP instead of FSDP2: DCP reshards each stage's parameters and Adam's state.
    run = resume_from_copy(pp_fsdp, tmp_path, PP_TP)
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    assert "[rank0]:resumed from step_000002 (attempt 0): next step 3" in run.text, run.explain()
    assert ("[rank0]:PP x FSDP2 x TP (pp=2, dp=1, tp=2) on 4 ranks; global batch 8 = 1 x 8 rows; "
            "Schedule1F1B, 2 microbatches of 4") in run.text, run.explain()
    assert_matches(run, one_process, steps=[3, 4])


BAD_LAYOUTS = {  # flags on 2 ranks -> the one line rank 0 prints
    "--parallel fsdp --pp 2 --dp 2": "--pp 2 x --dp 2 x tp 1 = 4 ranks, not the world size 2",
    "--parallel fsdp --pp 3": "--pp 3: more stages than the model's 2 decoder layers (each stage holds at least one)",
    "--parallel fsdp --pp 2 --microbatches 4 --batch 6":
        "--batch 6 does not divide into dp 1 x 4 microbatches (set --batch or --microbatches)",
}


@pytest.mark.slow
def test_bad_layouts_are_one_line_before_any_rank_starts():
    # All three at once; local.sh asks train.py --check-only (world size 2) before torchrun starts a rank.
    commands = [["bash", str(LAUNCH / "local.sh"), str(TRAIN), *flags.split()] for flags in BAD_LAYOUTS]
    run = run_all(commands, launch_env(NPROC="2"), timeout_s=120)
    assert not run.leftovers, run.leftovers
    for (flags, line), rc, out in zip(BAD_LAYOUTS.items(), run.returncodes, run.outputs):
        assert rc == 2, f"{flags}\n{run.explain()}"
        assert out.splitlines() == [f"train.py: error: {line}"], f"{flags}\n{out}"  # no traceback, no torchrun


@pytest.mark.parametrize("flags, world, problem", [
    ("--parallel fsdp --pp 2", 4, None),
    ("--parallel 2d --tp 2 --pp 2", 8, None),
    ("--parallel 2d --tp 2", 4, None),  # pp=1: today's layouts pass untouched
    ("--parallel ddp --pp 2", 4, "--pp 2 needs --parallel fsdp or 2d"),
    ("--parallel 2d --tp 2 --pp 2", 6, "--pp 2 x tp 2 = 4 does not divide the world size 6"),
    ("--parallel 2d --tp 2 --pp 2 --dp 2", 4, "--pp 2 x --dp 2 x tp 2 = 8 ranks, not the world size 4"),
    ("--parallel 2d --tp 2", 3, "--tp 2 does not divide the world size 3"),
    ("--parallel 2d --tp 2 --pp 2 --batch 6", 8, "--batch 6 does not divide into dp 2 x 2 microbatches"),
    ("--parallel fsdp --pp 2 --microbatches 0", 4, "--microbatches 0: must be at least 1"),
    ("--parallel fsdp --pp 2 --microbatches 1", 4, "--microbatches 1: Schedule1F1B needs at least one per stage (2)"),
    ("--parallel fsdp --microbatches 2", 4, "--microbatches 2 needs --pp > 1"),
    ("--parallel fsdp --batch 6", 4, "--batch 6 does not divide among 4 dp ranks"),
])
def test_layout_problem(flags, world, problem, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    train = load_train()
    args = train.parse_args(flags.split())  # no RANK here: parse_args checks nothing, layout_problem does
    found = train.layout_problem(args, world)
    assert (found is None) if problem is None else (found or "").startswith(problem), found


def test_layout_fills_the_sizes(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    train = load_train()
    args = train.parse_args("--parallel 2d --tp 2 --pp 2 --batch 8".split())
    assert train.layout_problem(args, 8) is None and (args.pp, args.dp, args.microbatches) == (2, 2, 2)


@pytest.mark.slow
def test_3d_on_eight_ranks_equals_one_process():
    # PP x FSDP2 x TP, 2 x 2 x 2: 8 ranks on this machine's cores (45 s measured at load 4-7 on 2 cores).
    args = ["--parallel", "2d", "--tp", "2", "--pp", "2", "--steps", "3"]
    run = run_all([["bash", str(LAUNCH / "local.sh"), str(TRAIN), *args]], launch_env(NPROC="8"), timeout_s=400)
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    assert ("[rank0]:PP x FSDP2 x TP (pp=2, dp=2, tp=2) on 8 ranks; global batch 8 = 2 x 4 rows; "
            "Schedule1F1B, 2 microbatches of 2") in run.text, run.explain()
    assert_matches(run, reference(["--steps", "3"]), steps=[1, 2, 3])
