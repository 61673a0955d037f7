"""course_lib.launcher.torchrun: real `torchrun --standalone` launches on gloo, 2 and 4 ranks.

Each launch costs seconds, so one launch per scenario is shared by the tests
that look at it (module-scoped fixtures). Every launch goes through
`proc_helpers.launch`, which records each descendant while it runs and finds
leftovers afterwards by an environment mark, even re-parented ones.
"""

import pathlib
import re
import signal
import time

import psutil
import pytest
import torch

from course_lib.backend_choice import BackendChoice
from course_lib.launcher.torchrun import run_torchrun
from course_lib.launcher.rank_output import exit_summary, rank_block
from course_lib.magics.args import RankFailure
from course_lib.magics.cell_end import finish
from course_lib.magics.torchrun_magic import cell_end
from proc_helpers import RAISING_LINE, launch, no_new_children, raising_launch, startup_deadline_s, still_alive

WORLD_SIZES = [2, 4]


@pytest.fixture(autouse=True)
def _no_child_survives_a_test():
    with no_new_children():
        yield


def _assert_nothing_left(run, *pids):
    """Every process seen during the launch, and the given PIDs, are gone."""
    assert run.leftovers == []
    assert still_alive(run.seen.values(), timeout_s=0.5) == []
    for pid in pids:
        assert pid in run.seen, f"PID {pid} was never seen by the ledger"
        assert not psutil.pid_exists(pid) or not still_alive([run.seen[pid]], timeout_s=0.5)


def _live_text(run, rank, stream):
    return "".join(text for r, s, text in run.chunks if (r, s) == (rank, stream))


# ---------------------------------------------------------------- a run that works

OK_SCRIPT = """
import os
import torch
import torch.distributed as dist
import course_lib as cl

info = cl.init(timeout_s=30)
torch.manual_seed(info.rank)
local = torch.randn(6)
print(f"rank {info.rank} of {info.world_size}", flush=True)
print(f"pid {os.getpid()}", flush=True)
reduced = local.clone()
dist.all_reduce(reduced)  # SUM over ranks
cl.publish("local", local)
cl.publish("reduced", reduced)
cl.publish("info", {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                    "device": str(info.device), "pid": os.getpid()})
cl.publish("word", f"r{info.rank}")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def ok_run(request):
    return launch(OK_SCRIPT, request.param, timeout_s=90)


def test_ok_every_rank_exits_0(ok_run):
    result = ok_run.result
    n = result.nproc
    assert result.ok, result.agent_output
    assert result.exit_codes == {r: 0 for r in range(n)}
    assert (result.failed, result.unfinished, result.root_cause) == ([], [], None)
    assert (result.timed_out, result.interrupted, result.agent_exit_code) == (False, False, 0)
    assert (result.choice.backend, result.choice.device_type) == ("gloo", "cpu")


def test_ok_each_rank_output_is_its_own_in_order(ok_run):
    result = ok_run.result
    n = result.nproc
    pids = {r: v["pid"] for r, v in result.results["info"].items()}
    assert list(result.stdout) == list(range(n))
    for r in range(n):
        assert result.stdout[r] == f"rank {r} of {n}\npid {pids[r]}\n"
        assert result.stderr[r] == ""


def test_ok_live_output_adds_up_to_the_final_output(ok_run):
    for r in range(ok_run.result.nproc):
        assert _live_text(ok_run, r, "stdout") == ok_run.result.stdout[r]
        assert _live_text(ok_run, r, "stderr") == ok_run.result.stderr[r]


def test_ok_cell_end_prints_rank_blocks_in_rank_order(ok_run, capsys):
    result = ok_run.result
    finish(cell_end(result, 90), expect_failure=False)  # what %%torchrun shows after its header
    out, err = capsys.readouterr()
    assert out == "".join(rank_block(r, result.stdout[r]) for r in range(result.nproc))
    assert err == ""
    ranks_in_order = [int(line.split("]")[0].removeprefix("[rank ")) for line in out.splitlines()]
    assert ranks_in_order == sorted(ranks_in_order)


def test_ok_all_reduce_matches_the_single_process_sum(ok_run):
    n = ok_run.result.nproc
    inputs = []
    for r in range(n):
        torch.manual_seed(r)
        inputs.append(torch.randn(6))
    expected = torch.stack(inputs).sum(dim=0)
    results = ok_run.result.results
    for r in range(n):
        torch.testing.assert_close(results["local"][r], inputs[r], rtol=0, atol=0)
        torch.testing.assert_close(results["reduced"][r], expected)


def test_ok_publish_returns_rank_to_value_for_every_rank(ok_run):
    n = ok_run.result.nproc
    results = ok_run.result.results
    assert sorted(results) == ["info", "local", "reduced", "word"]
    for name, by_rank in results.items():
        assert list(by_rank) == list(range(n)), name
    assert results["word"] == {r: f"r{r}" for r in range(n)}
    for r, info in results["info"].items():
        assert info["rank"] == r
        assert (info["world_size"], info["backend"], info["device"]) == (n, "gloo", "cpu")
    assert all(isinstance(t, torch.Tensor) and t.shape == (6,) for t in results["reduced"].values())


def test_ok_no_process_left(ok_run):
    pids = [info["pid"] for info in ok_run.result.results["info"].values()]
    _assert_nothing_left(ok_run, *pids)


# ---------------------------------------------------------------- a rank that raises


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def raise_run(request):
    return raising_launch(request.param)


def test_raise_exit_codes_and_root_cause(raise_run):
    result = raise_run.result
    n = result.nproc
    bad = n - 1
    assert not result.ok
    # torchrun ends the ranks still running with SIGTERM once one fails.
    assert result.exit_codes == {**{r: -signal.SIGTERM for r in range(n - 1)}, bad: 1}
    assert result.root_cause == bad
    assert result.failed == list(range(n))
    assert (result.timed_out, result.interrupted, result.unfinished) == (False, False, [])
    assert result.agent_exit_code not in (0, None)


def test_raise_traceback_names_the_cell_not_the_temp_file(raise_run):
    result = raise_run.result
    bad = result.nproc - 1
    err = result.stderr[bad]
    assert f'File "<cell>", line {RAISING_LINE}, in <module>' in err
    assert err.rstrip().endswith(f"ValueError: rank {bad} gives up")
    for text in [*result.stdout.values(), *result.stderr.values(), result.agent_output]:
        assert "cell.py" not in text and "course_lib_" not in text
    assert all(result.stdout[r] == f"rank {r} ready\n" for r in range(result.nproc))


def test_raise_cell_end_puts_the_failing_rank_first_and_summarises(raise_run, capsys):
    result = raise_run.result
    bad = result.nproc - 1
    with pytest.raises(RankFailure, match=rf"^rank {bad} failed with exit code 1: ValueError: rank {bad} gives up$"):
        finish(cell_end(result, 90), expect_failure=False)
    out, err = capsys.readouterr()
    assert err.startswith(f"[rank {bad}] Traceback") or err.startswith(f"[rank {bad}] [rank{bad}]: Traceback")
    assert out.splitlines()[-1] == exit_summary(result.exit_codes)
    finish(cell_end(result, 90), expect_failure=True)  # a lesson's failure on purpose: said, not raised
    assert capsys.readouterr().out.splitlines()[-2:] == [
        exit_summary(result.exit_codes),
        f"as expected, rank {bad} failed with exit code 1: ValueError: rank {bad} gives up",
    ]


def test_raise_no_process_left(raise_run):
    _assert_nothing_left(raise_run)


# ---------------------------------------------------------------- exit codes and signals


@pytest.fixture(scope="module")
def exit3_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cwd")
    run = launch(
        """
        import os, pathlib, time
        print(os.getcwd(), flush=True)
        # Rank 0 exits only once rank 1 has printed: the launcher stops rank 1 as soon as rank 0 dies,
        # and a loaded machine (CI beside another suite) once let that happen before rank 1 had printed.
        if os.environ["RANK"] == "0":
            deadline = time.monotonic() + 30
            while not pathlib.Path("rank1_printed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(3)
        pathlib.Path("rank1_printed").touch()
        time.sleep(60)
        """,
        2,
        timeout_s=60,
        cwd=str(workdir),
    )
    return run, workdir


def test_os_exit_code_is_reported(exit3_run):
    run, _ = exit3_run
    result = run.result
    assert result.exit_codes == {0: 3, 1: -signal.SIGTERM}
    assert result.root_cause == 0
    assert exit_summary(result.exit_codes) == "exit: rank 0 -> 3; rank 1 -> SIGTERM"
    _assert_nothing_left(run)


def test_ranks_run_in_the_given_cwd(exit3_run):
    run, workdir = exit3_run
    assert run.result.stdout == {0: f"{workdir}\n", 1: f"{workdir}\n"}


def test_sigkilled_rank_is_reported_by_signal(tmp_path):
    # Rank 1 dies only once rank 0 has printed its PID: the launcher stops rank 0 as soon as rank 1
    # dies, and a loaded machine once let that happen before rank 0 had printed anything.
    run = launch(
        """
        import os, pathlib, signal, time
        print(f"pid {os.getpid()}", flush=True)
        if os.environ["RANK"] == "0":
            pathlib.Path("rank0_printed").touch()
        else:
            deadline = time.monotonic() + 30
            while not pathlib.Path("rank0_printed").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
        2,
        timeout_s=60,
        cwd=str(tmp_path),
    )
    result = run.result
    assert result.exit_codes == {0: -signal.SIGTERM, 1: -signal.SIGKILL}
    assert result.root_cause == 1
    assert "rank 1 -> SIGKILL" in exit_summary(result.exit_codes)
    pids = [int(result.stdout[r].split()[1]) for r in range(2)]
    _assert_nothing_left(run, *pids)


# ---------------------------------------------------------------- deadline


@pytest.fixture(scope="module")
def deadline_run():
    # Each rank starts a helper process of its own, then never finishes.
    return launch(
        """
        import os, subprocess, time
        helper = subprocess.Popen(["sleep", "300"])
        print(f"pid {os.getpid()} helper {helper.pid}", flush=True)
        while True:
            time.sleep(1)
        """,
        2,
        timeout_s=startup_deadline_s(imports=0),  # the ranks must have printed by then
    )


def test_deadline_returns_in_bounded_time(deadline_run):
    result = deadline_run.result
    assert deadline_run.timeout_s <= deadline_run.elapsed_s < deadline_run.timeout_s + 5
    assert result.timed_out and not result.ok
    assert result.unfinished == [0, 1]
    assert result.exit_codes == {0: None, 1: None}
    assert (result.root_cause, result.agent_exit_code, result.interrupted) == (None, None, False)
    assert exit_summary(result.exit_codes) == "exit: ranks 0, 1 -> still running, killed"


def test_deadline_kills_ranks_and_their_children(deadline_run):
    result = deadline_run.result
    pids = []
    for r in range(2):
        words = result.stdout[r].split()
        assert words[0::2] == ["pid", "helper"], result.stdout
        pids += [int(words[1]), int(words[3])]
    assert sorted(deadline_run.names[p] for p in pids[1::2]) == ["sleep", "sleep"]
    _assert_nothing_left(deadline_run, *pids)


def test_stuck_collective_ends_by_the_deadline():
    # Rank 1 skips the all_reduce rank 0 waits in. The deadline counts from when both ranks' process group is
    # up (however long `import torch` took on this machine): 4 s to reach the collective and print.
    timeout_s = 4
    run = launch(
        """
        import time
        import torch
        import torch.distributed as dist
        import course_lib as cl
        info = cl.init(timeout_s=60)
        if info.rank == 0:
            print("entering all_reduce", flush=True)
            dist.all_reduce(torch.ones(1))
            print("all_reduce returned", flush=True)
        else:
            print("skipping the all_reduce", flush=True)
            time.sleep(600)
        """,
        2,
        timeout_s=timeout_s,
    )
    result = run.result
    assert result.ready_s is not None and run.elapsed_s < result.ready_s + timeout_s + 5
    assert result.stdout == {0: "entering all_reduce\n", 1: "skipping the all_reduce\n"}
    assert result.timed_out or result.failed
    assert not result.ok
    if result.timed_out:
        assert result.unfinished == [0, 1]
        # The ledgers and stacks say who is stuck where (the sleep is script
        # line 13, cell line 14 below the hook line).
        assert result.diagnosis == [
            "rank 0 is waiting in all_reduce #1 (4 B, world group)",
            "rank 1 is running Python at cell line 14, before any collective",
        ]
        assert 'File "<cell>", line 14' in result.stacks[1]
        assert [(e["op"], e["end"]) for e in result.ledgers[0]] == [("all_reduce", None)]
    _assert_nothing_left(run)


def test_the_deadline_counts_from_when_every_rank_has_started_its_group():
    """A slow start (a loaded machine's `import torch`; here a sleep longer than the deadline before it) is not
    the cell's time: the cell finishes, where a deadline counted from the launch would have killed it. The
    deadline leaves the ranks time to exit after their group is up, even on a busy machine. A cell that imports
    no torch counts from the launch (test_deadline_returns_in_bounded_time)."""
    timeout_s = max(4.0, startup_deadline_s(imports=0))
    run = launch(
        f"""
        import time
        time.sleep({timeout_s + 1})
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("done after its imports", flush=True)
        """,
        2,
        timeout_s=timeout_s,
    )
    result = run.result
    assert not result.timed_out and result.ok, result.stdout
    assert result.stdout == {0: "done after its imports\n", 1: "done after its imports\n"}
    assert result.ready_s is not None and result.ready_s > timeout_s  # from the launch it would have been killed


def test_cell_without_cl_init_is_recorded_and_diagnosed():
    # A script that starts its own process group and never imports course_lib:
    # the hook on line 1 still records its collectives (whichever way they are
    # imported) and dumps the stuck ranks' stacks at the deadline.
    timeout_s = 6  # after both ranks' init_process_group returned
    run = launch(
        """
        import time
        import torch
        import torch.distributed as dist
        from torch.distributed import broadcast
        dist.init_process_group("gloo")
        t = torch.ones(8)
        broadcast(t, src=0)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            time.sleep(600)
        """,
        2,
        timeout_s=timeout_s,
    )
    result = run.result
    assert result.ready_s is not None and run.elapsed_s < result.ready_s + timeout_s + 5
    assert not result.ok
    assert [(e["op"], e["bytes"], e["end"] is not None) for e in result.ledgers[1]] == [("broadcast", 32, True)]
    assert [(e["op"], e["bytes"]) for e in result.ledgers[0]][0] == ("broadcast", 32)
    assert result.timed_out  # gloo's default timeout (30 min) is far beyond the deadline
    assert result.diagnosis == [
        "rank 0 is waiting in all_reduce #2 (32 B, world group)",
        "rank 1 last completed broadcast #1 (32 B, world group) and is running Python at cell line 13",
    ]
    assert 'File "<cell>", line 13' in result.stacks[1]
    _assert_nothing_left(run)


def test_future_import_cell_still_runs_and_is_recorded():
    # `from __future__` must be a file's first statement, so such a script gets
    # no hook line; it must still run, and the cell runner's hook records it.
    # The backend is a BackendChoice made by the caller (as %%torchrun does): used as is.
    choice = BackendChoice("gloo", "cpu", "decided by the caller")
    run = launch(
        """from __future__ import annotations
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        print("ok", flush=True)
        """.replace("\n        ", "\n"),
        2,
        backend=choice,
    )
    assert run.result.ok, run.result.stderr
    assert run.result.choice is choice
    assert run.result.stdout == {0: "ok\n", 1: "ok\n"}
    assert {r: [e["op"] for e in ledger] for r, ledger in run.result.ledgers.items()} == {0: ["barrier"], 1: ["barrier"]}
    _assert_nothing_left(run)


# ---------------------------------------------------------------- rank helpers on a machine with a GPU


def test_device_mesh_follows_the_backend_not_the_gpu():
    # FSDP2 / DTensor under gloo need a CPU mesh even where a GPU exists: a "cuda" mesh fails with
    # "invalid device ordinal" or a segfault (pytorch#132471). The cell imitates a GPU machine; the
    # helper must still take the mesh's device type from the backend choice (gloo -> cpu).
    run = launch(
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import Shard, distribute_tensor
        import course_lib as cl

        torch.cuda.is_available = lambda: True  # as on a machine with a GPU
        info = cl.init(timeout_s=30)
        mesh = cl.device_mesh(info.world_size, mesh_dim_names=("dp",))
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total, group=mesh.get_group("dp"))
        full = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).full_tensor()
        cl.publish("mesh", (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, total.item(), full.tolist()))
        """,
        2,
        timeout_s=60,
        backend="gloo",
    )
    assert run.result.ok, run.result.stderr
    assert run.result.results["mesh"] == {r: ("cpu", [0, 1], ("dp",), 3.0, [0.0, 1.0, 2.0, 3.0]) for r in range(2)}
    _assert_nothing_left(run)


# ---------------------------------------------------------------- regressions (bugs found by these tests)


def test_helper_started_just_before_a_rank_exits_is_cleaned_up():
    run = launch(
        """
        import os, subprocess
        helper = subprocess.Popen(["sleep", "300"])
        print(helper.pid, flush=True)
        os._exit(0)
        """,
        2,
        timeout_s=60,
    )
    assert run.result.ok
    assert run.leftovers == []  # the helper killed the survivors after recording them


def test_deadline_before_ranks_start_does_not_report_success():
    run = launch("print('hi')\n", 2, timeout_s=0.3)
    result = run.result
    assert result.timed_out
    assert run.leftovers == []
    assert 0 not in result.exit_codes.values(), result.exit_codes
    assert result.not_started == [0, 1]
    assert result.unfinished == []


FORGETS_DESTROY = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(t.item())
"""


def test_a_cell_that_forgets_destroy_process_group_ends_cleanly_every_time():
    # On torch 2.13 such a script aborted at exit in some runs (2 of 10 here, with correct results printed).
    # Two defences now: the line-1 hook destroys the group at exit, and the rank ends without the
    # interpreter's finalization (rank/process_exit.py; tests/test_process_exit.py makes that abort certain,
    # so four runs here, not ten, check the path a forgetful cell takes).
    from concurrent.futures import ThreadPoolExecutor

    from course_lib.launcher.torchrun import run_torchrun

    # Two launches at a time (two cores): four process exits per rank, in half the wall time.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_torchrun(FORGETS_DESTROY, 2, backend="gloo", timeout_s=60), range(4)))
    for result in results:
        assert result.ok and result.exit_codes == {0: 0, 1: 0}, result.stderr
        assert result.stdout == {0: "2.0\n", 1: "2.0\n"}
        assert "terminate called" not in "".join(result.stderr.values())


# A rank that fails on the first attempt only; no process group, so the restart itself cannot flake on gloo.
FAILS_ON_ATTEMPT_0 = """\
import os
import sys
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
print(f"attempt {attempt}, rank {rank}")
if attempt == 0 and rank == 1:
    print("rank 1 gives up", file=sys.stderr)
    os._exit(3)
"""


def test_max_restarts_runs_again_and_shows_each_attempt_apart():
    from course_lib.launcher.torchrun import run_torchrun
    from course_lib.magics.torchrun_magic import cell_end

    result = run_torchrun(FAILS_ON_ATTEMPT_0, 2, backend="gloo", timeout_s=60, max_restarts=1)
    assert result.ok and result.exit_codes == {0: 0, 1: 0}, result.agent_output
    # The last attempt's output, then each earlier one's: how it ended and what each rank printed.
    assert result.stdout == {0: "attempt 1, rank 0\n", 1: "attempt 1, rank 1\n"}
    assert result.stderr == {0: "", 1: ""}
    [(ended, stdout)] = result.earlier_attempts
    assert ended == ("attempt 0 ended: rank 1 failed with exit code 3; torchrun stopped the other ranks and "
                     "started every rank again (restart 1 of at most 1)"), ended
    assert stdout[1] == "attempt 0, rank 1\n"
    assert cell_end(result, 60).earlier_attempts == result.earlier_attempts


def test_without_restarts_a_failed_attempt_is_the_result():
    from course_lib.launcher.torchrun import run_torchrun

    result = run_torchrun(FAILS_ON_ATTEMPT_0, 2, backend="gloo", timeout_s=60)
    assert not result.ok and result.exit_codes[1] == 3 and result.earlier_attempts == []
    assert "rank 1 gives up" in result.stderr[1]


# Both attempts talk (a store prefix per attempt: a gloo group restarted without one can fail to connect).
TALKS_IN_BOTH_ATTEMPTS = """\
import os
import torch
import torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
store, rank, world_size = next(dist.rendezvous("env://"))
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world_size)
if attempt == 0:
    dist.all_reduce(torch.ones(2))
    dist.barrier()
    if rank == 1:
        os._exit(3)
else:
    dist.barrier()
dist.destroy_process_group()
"""


def test_after_a_restart_the_ledgers_are_the_last_attempts():
    from course_lib.launcher.torchrun import run_torchrun

    result = run_torchrun(TALKS_IN_BOTH_ATTEMPTS, 2, backend="gloo", timeout_s=90, max_restarts=1)
    assert result.ok and len(result.earlier_attempts) == 1, (result.agent_output, result.stderr)
    assert {r: [e["op"] for e in entries] for r, entries in result.ledgers.items()} == {0: ["barrier"], 1: ["barrier"]}


# ---------------------------------------------------------------- an interrupt (the toolbar's Stop)

INTERRUPTED = """\
import os, time
print("started", flush=True)
if os.environ["RANK"] == "1":
    import slowmod  # slowmod sleeps as it is imported: this rank is still starting up
time.sleep(600)
"""


def test_interrupt_says_in_one_line_per_rank_where_it_was_and_keeps_the_stacks_in_a_file(tmp_path, capsys):
    from course_lib.magics.args import CellInterrupted

    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(600)\n")
    printed: list[int] = []
    seen_all: list[float] = []

    def on_output(rank, stream, text):
        printed.extend([rank] * text.count("started"))

    def interrupt_once_both_run():
        # Stop pressed half a second after both ranks printed: rank 1 is then inside `import slowmod`.
        if sorted(printed) == [0, 1]:
            seen_all.append(seen_all[0] if seen_all else time.monotonic())
            if time.monotonic() - seen_all[0] > 0.5:
                raise KeyboardInterrupt

    result = run_torchrun(INTERRUPTED, 2, backend="gloo", timeout_s=startup_deadline_s(imports=0) + 30,
                          on_output=on_output, on_poll=interrupt_once_both_run, cwd=str(tmp_path),
                          first_line="%%torchrun -n 2")
    assert result.interrupted and not result.timed_out and result.unfinished == [0, 1]
    with pytest.raises(CellInterrupted):
        finish(cell_end(result, 60), expect_failure=False)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[:2] == ["[rank 0] started", "[rank 1] started"]
    assert lines[2:5] == [
        "interrupted; every process of this cell was killed. Where each rank was:",
        "rank 0: at cell line 6, before any collective",  # time.sleep (the magic is line 1)
        "rank 1: starting up (importing slowmod at cell line 5)",
    ]
    # No stack in the cell (no import machinery, no path of this machine), and no rank called stuck.
    assert err == "" and "stuck" not in out and "<frozen" not in out and str(tmp_path) not in out
    saved = re.fullmatch(r"\(the ranks' Python stacks, for whoever debugs the course: (\S+)\)", lines[5])
    assert saved and len(lines) == 6, lines
    stacks = pathlib.Path(saved.group(1))
    try:
        text = stacks.read_text()
        assert 'slowmod.py", line 2 in <module>' in text and "<frozen importlib._bootstrap>" in text
        assert text.startswith("rank 0, Python stack") and "\nrank 1, Python stack" in text
    finally:
        stacks.unlink()
