"""Bad input to launch/ is one line, and loses nothing (issue 39, section 3).

- train.py's flags and --ckpt-dir are checked before any rank starts: in-process for each input of the workshop
  review's table, and through the launchers (local.sh and multinode.sh run `train.py --check-only WORLD` before
  torchrun): one line, exit 2. Started by torchrun by hand, the line comes from local rank 0 inside torchrun's report.
- multinode.sh: a node that never arrives ends after JOIN_TIMEOUT with one line naming the endpoint; a port held
  by another program is one line at once.
- A newest checkpoint that does not load (COMPLETE without .metadata, garbage .metadata, a truncated shard) is
  named in one line and the run resumes from the previous one, across modes and world sizes (one process's
  checkpoint, resumed by FSDP2 on 2 ranks), to one process's loss; no file of the folder changes (hashed).

All launches of this file start at once, in two fixtures: one 2-rank training run, the rest stop within seconds.
"""

import os
import re
import socket

import pytest
import torch

from launch_helpers import (LAUNCH, TRAIN, file_hashes, free_port, launch_env, load_train, losses, reference,
                            run_all, timestamped, unstamp)

HELLO = LAUNCH / "scripts" / "hello.py"

JOIN_TIMEOUT = 6


@pytest.fixture()
def train(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return load_train()


@pytest.mark.parametrize("flags, world, problem", [
    ("--tp 0", 2, "--tp 0: must be at least 1"),  # was a ZeroDivisionError
    ("--ckpt-every 0", 2, "--ckpt-every 0: must be at least 1"),  # was a ZeroDivisionError after step 1
    ("--keep 0", 2, "--keep 0: must be at least 1"),  # kept every checkpoint
    ("--steps -3", 2, "--steps -3: must be at least 1"),  # 'nothing to do: the checkpoint is at step 0 of -3'
    ("--batch 0", 2, "--batch 0: must be at least 1"),
    ("--parallel 2d --tp 2", 3, "--tp 2 does not divide the world size 3"),
    ("--parallel 2d --tp 3", 4, "--tp 3 must divide the heads (4) and KV heads (2)"),
    ("--parallel ddp --batch 7", 2, "--batch 7 does not divide among 2 dp ranks"),
    ("--parallel ddp --keep 1 --ckpt-every 1 --steps 1", 2, None),
])
def test_each_bad_input_is_one_line(train, flags, world, problem):
    found = train.check(train.parse_args(flags.split()), world)
    assert found == problem


def test_ckpt_dir_that_cannot_be_written_is_found_at_once(train, tmp_path):
    (tmp_path / "a_file").write_text("")
    args = train.parse_args(["--ckpt-dir", str(tmp_path / "a_file" / "ckpt")])
    assert train.check(args, 2) == (f"--ckpt-dir {tmp_path / 'a_file' / 'ckpt'}: cannot write there (Not a directory): "
                                    f"checkpoints could not be saved")
    # A folder that does not exist yet is created (parents too) and probed; the probe file is gone afterwards.
    args = train.parse_args(["--ckpt-dir", str(tmp_path / "new" / "ckpt")])
    assert train.check(args, 2) is None and list((tmp_path / "new" / "ckpt").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_read_only_ckpt_dir_is_found_at_once(train, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt.chmod(0o555)
    try:
        assert "cannot write there (Permission denied)" in train.check(train.parse_args(["--ckpt-dir", str(ckpt)]), 2)
    finally:
        ckpt.chmod(0o755)


def test_parse_errors_and_check_only_are_one_line(train, capsys):
    for argv, code, line in [
        (["--paralel", "ddp"], 2,
         "train.py: error: unrecognized arguments: --paralel ddp (python launch/train.py --help lists the flags)"),
        (["--parallel", "zero"], 2, "train.py: error: argument --parallel: invalid choice: 'zero' (choose from "),
        (["--check-only", "2", "--tp", "0"], 2, "train.py: error: --tp 0: must be at least 1"),
        # an elastic job (1 to 3 nodes of 1 rank) is checked on every world size it may run on
        (["--check-only", "1,2,3", "--parallel", "fsdp", "--batch", "4"], 2,
         "train.py: error: --batch 4 does not divide among 3 dp ranks"),
        (["--check-only", "2,4", "--parallel", "fsdp", "--batch", "4"], 0, None),
        (["--steps", "0"], 2, "train.py: error: --steps 0: must be at least 1"),  # one process: the sizes too
    ]:
        with pytest.raises(SystemExit) as stop:
            train.main(argv)
        out, err = capsys.readouterr()
        assert (stop.value.code, out) == (code, ""), argv
        # (argparse's quotes round the choices differ between Python versions: the line's start is compared)
        assert [said[:len(line)] for said in err.splitlines()] == ([line] if line else []), argv


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Every launch that stops before training, all at once: local.sh and multinode.sh on bad flags, torchrun by
    hand on a bad flag, multinode.sh alone (a node that never arrives), multinode.sh on a port another program holds."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)  # a program that holds the port and never answers
    port = taken.getsockname()[1]
    common = dict(NPROC="1", MAX_RESTARTS="0", GLOO_SOCKET_IFNAME="lo", JOIN_TIMEOUT=str(JOIN_TIMEOUT))
    commands = {
        "local": ["env", "NPROC=2", "bash", str(LAUNCH / "local.sh"), str(TRAIN), "--tp", "0"],
        "torchrun": [launch_env()["PYTHON"], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     "--tee", "3", "--role", "rank", str(TRAIN), "--tp", "0"],
        "elastic": ["env", "NNODES=1:3", "bash", str(LAUNCH / "multinode.sh"), str(TRAIN), "--parallel", "fsdp",
                    "--batch", "4"],
        # (hello.py has no --check-only: one Python fewer to start on these two)
        "alone": timestamped(["env", f"RDZV_ENDPOINT=127.0.0.1:{free_port()}", "RDZV_ID=alone", "bash",
                              str(LAUNCH / "multinode.sh"), str(HELLO)]),
        "taken": ["env", f"RDZV_ENDPOINT=127.0.0.1:{port}", "bash", str(LAUNCH / "multinode.sh"), str(HELLO)],
    }
    try:
        run = run_all(list(commands.values()), launch_env(**common), timeout_s=120)
    finally:
        taken.close()
    return {name: run.part(i) for i, name in enumerate(commands)}, run


@pytest.mark.slow
def test_launchers_say_a_bad_flag_in_one_line_before_any_rank_starts(quick):
    runs, everything = quick
    assert not everything.leftovers, everything.leftovers
    assert runs["local"].returncodes == [2], runs["local"].explain()
    assert runs["local"].text.splitlines() == ["train.py: error: --tp 0: must be at least 1"]
    # multinode.sh asks for every world size of NNODES=1:3 x NPROC=1 before it starts its agent
    assert runs["elastic"].returncodes == [2], runs["elastic"].explain()
    assert runs["elastic"].text.splitlines() == ["train.py: error: --batch 4 does not divide among 3 dp ranks"]


@pytest.mark.slow
def test_torchrun_by_hand_shows_rank_0s_line_once_inside_its_report(quick):
    run = quick[0]["torchrun"]
    assert run.returncodes == [1], run.explain()  # torchrun fails the job: local rank 0 exited 2, rank 1 with 0
    ranks_said = [ln for ln in run.text.splitlines() if ln.startswith("[rank")]
    assert ranks_said == ["[rank0]:train.py: error: --tp 0: must be at least 1"], run.text
    assert "exitcode  : 2" in run.text and losses(run.text) == ({}, None), run.text


@pytest.mark.slow
def test_a_node_that_never_arrives_ends_in_one_line_after_join_timeout(quick):
    runs, everything = quick
    run = runs["alone"]
    assert run.returncodes == [1], run.explain()
    stamps, lines = zip(*unstamp(run.text))
    endpoint = re.search(r"127\.0\.0\.1:\d+", lines[0]).group(0)
    assert lines[0] == f"multinode.sh: waiting up to {JOIN_TIMEOUT} s for 2 nodes at {endpoint}, id alone"
    # a note every ~15 s, or twice within a shorter timeout
    assert lines[1] == f"multinode.sh: still waiting for 2 nodes at {endpoint} (3 of {JOIN_TIMEOUT} s)", run.text
    assert list(lines[2:]) == [
        f"multinode.sh: no group of 2 nodes formed at {endpoint} (id alone) within {JOIN_TIMEOUT} s: check that "
        f"every node runs multinode.sh with the same NNODES, RDZV_ENDPOINT and RDZV_ID, that the host name "
        f"resolves on every node and its port is open between them (a firewall); JOIN_TIMEOUT waits longer"], run.text
    # from the waiting line to the last one: within JOIN_TIMEOUT + 10 s (torch's default would be 600 s of silence)
    assert stamps[-1] - stamps[0] < JOIN_TIMEOUT + 10, run.text


@pytest.mark.slow
def test_a_port_held_by_another_program_is_one_line(quick):
    run = quick[0]["taken"]
    assert run.returncodes == [2], run.explain()
    port = int(re.search(r"port (\d+)", run.text).group(1))
    assert run.text.splitlines() == [
        f"multinode.sh: port {port} at 127.0.0.1 (RDZV_ENDPOINT) is taken by another program, not a torchrun "
        f"rendezvous: pick a free port (the same on every node), e.g. RDZV_ENDPOINT=127.0.0.1:{port + 1}"], run.text


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    """One process saves steps 2, 4, 6, 8 (its losses are the reference); the three newest are then broken
    the three ways, and FSDP2 on 2 ranks resumes from the folder and trains step 3."""
    ckpt = tmp_path_factory.mktemp("fallback") / "ckpt"
    one_process = reference(["--steps", "8", "--ckpt-every", "2", "--keep", "4", "--ckpt-dir", str(ckpt)])
    saved = sorted(p.name for p in ckpt.iterdir())
    (ckpt / "step_000008" / ".metadata").unlink()  # COMPLETE without DCP's index
    (ckpt / "step_000006" / ".metadata").write_bytes(b"garbage")
    shard = ckpt / "step_000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])  # truncated
    before = file_hashes(ckpt)
    cmd = ["bash", str(LAUNCH / "local.sh"), str(TRAIN), "--parallel", "fsdp", "--steps", "3", "--ckpt-dir", str(ckpt)]
    run = run_all([cmd], launch_env(NPROC="2"), timeout_s=240)
    return one_process, saved, before, run, ckpt


def test_one_process_saves_its_checkpoints(fallback):
    # (one process used to save nothing with --ckpt-dir, and say nothing)
    assert fallback[1] == ["step_000002", "step_000004", "step_000006", "step_000008"]


@pytest.mark.slow
def test_a_newest_checkpoint_that_does_not_load_falls_back_and_loses_nothing(fallback):
    one_process, _, before, run, ckpt = fallback
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    said = [ln for ln in run.text.splitlines() if ln.startswith("[rank0]:") and "step" in ln and "/" not in ln]
    assert said[0] == "[rank0]:skipped step_000008: COMPLETE but no .metadata (DCP's index of the shards)", run.text
    assert said[1].startswith("[rank0]:could not load step_000006 (its .metadata does not read: "), run.text
    # (cut in half, torch.load finds no zip directory; cut near the end, EOFError, said as a truncated shard)
    assert re.fullmatch(r"\[rank0\]:could not load step_000004 \(\w+ on rank \d: .+\): trying the one before it; "
                        r"nothing deleted", said[2]), run.text
    # One process's checkpoint, resumed by FSDP2 on 2 ranks (another mode, another world size): one process's step 3.
    assert said[3] == "[rank0]:resumed from step_000002 (attempt 0): next step 3", run.text
    steps, final = losses(run.text)
    assert sorted(steps) == [3], run.text
    torch.testing.assert_close(torch.tensor(final), torch.tensor(one_process[0][3]), rtol=0, atol=2e-6)
    # Nothing deleted or changed (the rotation never touches a folder newer than the step it saved); step 3 is new.
    after = file_hashes(ckpt)
    assert {name: h for name, h in after.items() if name in before} == before
    assert sorted(set(after) - set(before)) == ["step_000003/.metadata", "step_000003/COMPLETE",
                                                "step_000003/__0_0.distcp", "step_000003/__1_0.distcp"]
