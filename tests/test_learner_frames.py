"""A learner's error shows the learner's frames, and an error that follows from another rank's exit says so.

Issue 12, defect 5. The course wraps every collective (rank/ledger.py) and runs
`%%dist` cells through its own loop (launcher/pool_worker.py): neither may
appear in a traceback. When a rank exits early, its peers' next collective fails
with gloo's raw "Connection closed by peer": the cell names the rank that exited
first and calls the others' errors consequences. (Interrupts, one line each:
test_magic_kernel.py and test_dist_magic.py; `%%dist` tracebacks: test_dist_magic.py.)

Real interpreters and real gloo groups throughout; the rank-level tests turn a
real launch into what the `%%torchrun` cell prints with the magic's own `cell_end`
and `finish`, without a kernel.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import course_lib
from course_lib.launcher.diagnosis import consequences, ended_first, first_failure, lost_peer
from course_lib.magics.args import RankFailure
from course_lib.magics.cell_end import finish
from course_lib.magics.torchrun_magic import cell_end
from course_lib.rank.ledger import read_ledger
from proc_helpers import launch

# ---------------------------------------------------------------- the ledger's wrapper leaves no frame

# A one-rank gloo group: a wrong argument fails inside torch, under the ledger's wrapper. The
# first error is caught, chained and printed with `hide_frames`; the second reaches the
# interpreter, which prints it through sys.excepthook (torch's "[rank0]:" prefix included).
WRONG_ARGUMENT_SCRIPT = textwrap.dedent("""
    import sys, traceback, torch, torch.distributed as dist
    from course_lib.rank import ledger
    ledger.install(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        try:
            dist.broadcast([1.0], src=0)
        except TypeError as exc:
            raise ValueError("caught and chained") from exc
    except ValueError as exc:
        print("".join(traceback.format_exception(ledger.hide_frames(exc))), flush=True)
    dist.all_reduce([1.0, 2.0])
""")
SCRIPT = "script.py"
BROADCAST_LINE, ALL_REDUCE_LINE = 8, 13  # lines of the script as the interpreter counts them


@pytest.fixture(scope="module")
def wrong_argument(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ledger")
    (folder / SCRIPT).write_text(WRONG_ARGUMENT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(course_lib.__file__).parents[1]))  # this course_lib
    done = subprocess.run([sys.executable, SCRIPT, "ledger.jsonl"], cwd=folder, env=env, timeout=120,
                          capture_output=True, text=True)
    return done, read_ledger(str(folder / "ledger.jsonl"))


def test_uncaught_collective_error_shows_the_learners_line_then_torch(wrong_argument):
    done, _ = wrong_argument
    assert done.returncode == 1
    err = done.stderr
    assert f'/{SCRIPT}", line {ALL_REDUCE_LINE}, in <module>' in err, err
    assert "[rank0]:     dist.all_reduce([1.0, 2.0])" in err
    assert "distributed_c10d.py" in err  # torch's own frames stay: the learner called torch
    assert "ledger.py" not in err and "in recorded" not in err, err
    assert err.rstrip().splitlines()[-2:] == [
        "[rank0]: TypeError: Invalid function argument. Expected parameter `tensor` of type torch.Tensor",
        "[rank0]:              but got <class 'list'> instead.",
    ]


def test_hide_frames_also_cleans_chained_errors(wrong_argument):
    done, _ = wrong_argument
    out = done.stdout
    assert f'/{SCRIPT}", line {BROADCAST_LINE}, in <module>' in out
    assert "The above exception was the direct cause of the following exception:" in out
    assert out.count("Traceback (most recent call last):") == 2
    assert "ledger.py" not in out and "in recorded" not in out, out


def test_the_ledger_still_records_both_failed_calls(wrong_argument):
    _, entries = wrong_argument
    assert [(e["op"], e["error"]) for e in entries] == [("broadcast", "TypeError"), ("all_reduce", "TypeError")]
    assert all(e["end"] is not None for e in entries)


# ---------------------------------------------------------------- a rank that exits early


def _prints_of(result):
    """What the `%%torchrun` cell shows for `result`: (stdout, stderr, RankFailure message)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(RankFailure) as failure:
        finish(cell_end(result, timeout_s=60), expect_failure=False)
    return out.getvalue(), err.getvalue(), str(failure.value)


# Rank 0 waits in all_reduce while rank 1 leaves. Rank 0 ignores SIGTERM: torchrun sends it
# to every rank once it sees one fail, and on a loaded machine it could otherwise cut
# rank 0's traceback short; rank 0 exits by itself right after printing it.
EARLY_EXIT_SCRIPT = """\
import signal, sys, torch, torch.distributed as dist
import course_lib as cl
info = cl.init(timeout_s=30)
if info.rank == 1:
    {leave}
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.all_reduce(torch.ones(2))
"""
ALL_REDUCE_CELL_LINE = 8  # line 7 of the script; the %%torchrun line is line 1
CONSEQUENCE = ("rank 0's error is a consequence of rank 1 exiting first: its all_reduce #1 (8 B, world group) "
               'found a peer gone ("Connection closed by peer")')
# gloo says "closed" or "reset" depending on which side of the socket notices first (a race, seen in CI).
CONSEQUENCE_EITHER = {CONSEQUENCE, CONSEQUENCE.replace("closed by peer", "reset by peer")}


@pytest.fixture(scope="module")
def rank_raises():
    return launch(EARLY_EXIT_SCRIPT.format(leave='raise ValueError("rank 1 gives up")'), 2, timeout_s=90)


@pytest.fixture(scope="module")
def rank_exits_0():
    return launch(EARLY_EXIT_SCRIPT.format(leave="sys.exit(0)"), 2, timeout_s=90)


def test_the_rank_that_raised_is_named_and_the_peers_gloo_error_is_a_consequence(rank_raises):
    result = rank_raises.result
    # torchrun's root cause may be either rank: rank 0 fails in the same second (a tie goes
    # to the lowest rank), and rank 1 may be ended by torchrun's SIGTERM while it exits.
    assert result.exit_codes[0] == 1 and result.exit_codes[1] in (1, -15), result.exit_codes
    out, err, failure = _prints_of(result)
    assert failure.startswith("rank 1 failed with ") and failure.endswith(": ValueError: rank 1 gives up"), failure
    assert CONSEQUENCE_EITHER & set(out.splitlines()), out
    assert err.startswith("[rank 1] Traceback (most recent call last):\n")  # the cause first
    rank0 = [line for line in err.splitlines() if line.startswith("[rank 0] ")]
    assert f'[rank 0]   File "<cell>", line {ALL_REDUCE_CELL_LINE}, in <module>' in rank0
    assert "Connection closed by peer" in rank0[-1] or "Connection reset by peer" in rank0[-1], rank0[-1]
    assert "course_lib" not in err  # neither the ledger's wrapper nor the cell hook
    assert rank_raises.leftovers == []


def test_a_rank_that_exited_0_is_named_for_its_peers_gloo_error(rank_exits_0):
    result = rank_exits_0.result
    # rank 1 exits 0, or is ended by torchrun's SIGTERM while it exits: it never joined all_reduce #1.
    assert result.exit_codes[0] == 1 and result.exit_codes[1] in (0, -15), result.exit_codes
    assert [(e["op"], e["error"]) for e in result.ledgers[0]] == [("all_reduce", "RuntimeError")]
    assert result.ledgers[1] == []
    out, err, failure = _prints_of(result)
    assert failure.startswith("rank 0 failed with exit code 1: RuntimeError: "), failure
    assert CONSEQUENCE_EITHER & set(out.splitlines()), out
    assert "ledger.py" not in err
    assert rank_exits_0.leftovers == []


# ---------------------------------------------------------------- the rules, on recorded text

GLOO_LOST = ("Traceback (most recent call last):\n"
             '  File "<cell>", line 8, in <module>\n'
             "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
             "by peer [127.0.0.1]:10166. This is typically caused by a remote worker crashing.\n")
RAISED = 'Traceback (most recent call last):\n  File "<cell>", line 6, in <module>\nValueError: rank 1 gives up\n'
FAILED_ALL_REDUCE = {"seq": 1, "op": "all_reduce", "group": "world", "bytes": 8, "error": "RuntimeError"}


def test_lost_peer_finds_gloos_words():
    assert lost_peer(GLOO_LOST) == "Connection closed by peer"
    assert lost_peer("RuntimeError: [pair.cc:598] Write error: Connection reset by peer") == "Connection reset by peer"
    assert lost_peer(RAISED) is None


@pytest.mark.parametrize(("codes", "errors", "reported", "first"), [
    ({0: 1, 1: 1}, {0: GLOO_LOST, 1: RAISED}, 0, 1),  # a tie in torchrun's whole seconds went to rank 0
    ({0: 1, 1: -15}, {0: GLOO_LOST, 1: RAISED}, 0, 1),  # rank 1 raised, then torchrun's SIGTERM ended it
    ({0: 1, 1: -15}, {0: GLOO_LOST, 1: ""}, 0, 0),  # rank 1 was only ended by torchrun: nobody else to name
    ({0: -15, 1: 1}, {0: "", 1: RAISED}, 1, 1),  # torchrun was right
    ({0: 1, 1: -9}, {0: GLOO_LOST, 1: ""}, 0, 1),  # killed (e.g. out of memory): a cause without a word
])
def test_first_failure(codes, errors, reported, first):
    assert first_failure(codes, errors, reported) == first


def test_ended_first_reads_who_never_joined_the_failed_collective():
    ledgers = {0: [FAILED_ALL_REDUCE], 1: [], 2: [{**FAILED_ALL_REDUCE, "error": None}]}
    codes = {0: 1, 1: -15, 2: -15}  # rank 2 was in the all_reduce when torchrun ended it
    assert ended_first(codes, {0: GLOO_LOST}, ledgers, first=0) == [1]
    assert ended_first({0: 1, 1: 0}, {0: GLOO_LOST}, {}, first=0) == [1]  # no ledger: the rank that exited 0
    assert ended_first({0: 1, 1: 1}, {0: GLOO_LOST, 1: RAISED}, ledgers, first=1) == [1]


def test_consequences_name_each_peer_and_nothing_without_a_cause():
    ledgers = {0: [FAILED_ALL_REDUCE]}
    assert consequences({0: GLOO_LOST, 1: RAISED}, [1], ledgers) == [CONSEQUENCE]
    assert consequences({0: GLOO_LOST, 2: GLOO_LOST}, [1], {}) == [
        f"rank {r}'s error is a consequence of rank 1 exiting first: it found a peer gone "
        '("Connection closed by peer")' for r in (0, 2)]
    assert consequences({0: GLOO_LOST}, [], ledgers) == []
    assert consequences({1: RAISED}, [1], ledgers) == []


# ---------------------------------------------------------------- an intended failure: the explanation first

def test_cut_traceback_keeps_the_error_line_without_the_build_path():
    from course_lib.launcher.rank_output import cut_traceback

    cut = cut_traceback("saved\n" + GLOO_LOST)
    assert cut == ("saved\nRuntimeError: Connection closed by peer [127.0.0.1]:10166. This is typically caused by a "
                   "remote worker crashing. (its traceback of 2 lines cut)\n")
    assert cut_traceback("no traceback here\n") == "no traceback here\n"


def _finish_prints(expect_failure: bool) -> tuple[str, str]:
    from course_lib.magics.cell_end import CellEnd

    end = CellEnd({0: "step 2 saved\n"}, {0: GLOO_LOST, 1: RAISED}, {}, {}, all_well="every rank exited 0", first=1,
                  exit_line="exit: rank 0 -> exit code 1; rank 1 -> exit code 1", consequences=[CONSEQUENCE],
                  failure="rank 1 failed with exit code 1: ValueError: rank 1 gives up")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.suppress(RankFailure):
        finish(end, expect_failure=expect_failure)
    return out.getvalue(), err.getvalue()


def test_an_expected_failure_explains_first_and_cuts_only_the_peers_traceback():
    out, err = _finish_prints(expect_failure=True)
    assert out.splitlines()[:2] == ["[rank 0] step 2 saved", CONSEQUENCE]   # the explanation before any traceback
    assert out.count(CONSEQUENCE) == 1
    assert err.startswith("[rank 1] Traceback (most recent call last):\n")  # the cause, whole
    rank0 = [line for line in err.splitlines() if line.startswith("[rank 0] ")]
    assert rank0 == ["[rank 0] RuntimeError: Connection closed by peer [127.0.0.1]:10166. This is typically caused "
                     "by a remote worker crashing. (its traceback of 2 lines cut)"]
    # An unexpected failure keeps every traceback whole, the explanation after it (the learner debugs it).
    out, err = _finish_prints(expect_failure=False)
    assert '[rank 0]   File "<cell>", line 8, in <module>' in err.splitlines()
    assert out.splitlines()[-1] == CONSEQUENCE
