"""The grader's ranks (grading/rank_set.py) are started once per submission and reused from run to run,
restarted only after a run that failed; a run on fewer ranks than the set sees its own world size; and
grading several submissions at once (grading/parallel.py) still blames a change to the grader's files
on the submission that made it."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import threading
import time

import nbformat
import pytest

import grading_answers as answers
from course_lib.grading.cells import exercise_cells
from course_lib.grading.checker import check_exercise, rank_set_for
from course_lib.grading.guard import FileGuard
from course_lib.grading.parallel import grade_in_parallel
from course_lib.grading.rank_set import RankSet
from course_lib.grading.registry import exercise, exercises_of_lesson
from course_lib.grading.report import item_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTIONS = exercise_cells(nbformat.read(ROOT / "solutions" / "01_process_groups_solutions.ipynb", as_version=4))

# Right on 4 ranks, raises on 2: the ring exercise runs 2 ranks first, then 4.
RAISES_ON_TWO_RANKS = answers.RING_SOLUTION.replace(
    "def ring_allreduce(tensor: torch.Tensor) -> None:\n",
    "def ring_allreduce(tensor: torch.Tensor) -> None:\n"
    "    if dist.get_world_size() == 2:\n        raise ValueError('two is too few')\n", 1)


def test_one_set_of_ranks_serves_every_run_of_a_submission():
    exercises = [exercise(i) for i in exercises_of_lesson("01")]
    with rank_set_for(exercises) as ranks:
        assert ranks.size == 4  # the largest run of lesson 01
        for found in exercises:
            items = check_exercise(found, SOLUTIONS[found.id], ranks=ranks)
            assert all(item.passed for item in items), "\n".join(map(item_line, items))
        assert ranks.runs == sum(len(found.runs) for found in exercises) == 5
        assert ranks.starts == 1  # not one launch per run


def test_a_failed_run_restarts_the_ranks_and_the_next_run_is_graded_afresh():
    ring = exercise("01.ring_allreduce")
    assert [run.nproc for run in ring.runs] == [2, 4]
    assert "raise ValueError" in RAISES_ON_TWO_RANKS
    with rank_set_for([ring]) as ranks:
        items = check_exercise(ring, RAISES_ON_TWO_RANKS, ranks=ranks)
        assert ranks.starts == 2
    first, second = ring.runs[0].items, ring.runs[1].items
    assert [item.score for item in items[:len(first)]] == [0] * len(first)
    assert "rank 0 raised at cell line" in items[0].message and "two is too few" in items[0].message
    assert all(item.passed for item in items[len(first):]), "\n".join(map(item_line, items))
    assert len(items) == len(first) + len(second)


# Right, with torch's autograd broadcast imported by the cell: torch.distributed.nn.functional binds its functions'
# default group (group.WORLD) when it is first imported, so the rank server imports it before any group exists.
ALLGATHER_NN_FUNCTIONAL = answers.ALLGATHER_SOLUTION.replace(
    "import torch.distributed as dist\n",
    "import torch.distributed as dist\nfrom torch.distributed.nn.functional import broadcast\n").replace(
    "        dist.broadcast(buffer, src=src)\n        gathered.append(buffer)",
    "        gathered.append(broadcast(buffer, src))")


def test_torchs_autograd_collectives_use_each_runs_group_on_reused_ranks():
    found = exercise("01.allgather_from_broadcast")
    assert [run.nproc for run in found.runs] == [2, 3]  # ranks 0 and 1 serve both runs
    assert "gathered.append(broadcast(buffer, src))" in ALLGATHER_NN_FUNCTIONAL
    with rank_set_for([found]) as ranks:
        items = check_exercise(found, ALLGATHER_NN_FUNCTIONAL, ranks=ranks)
        assert ranks.starts == 1
    assert all(item.passed for item in items), "\n".join(map(item_line, items))


def test_a_run_on_fewer_ranks_than_the_set_has_its_own_world_size():
    grid = exercise("01.grid_groups")  # 4 ranks; run it in a set of 6, two of which sit out
    assert [run.nproc for run in grid.runs] == [4]
    with RankSet(6, cpu_s=60) as ranks:
        items = check_exercise(grid, SOLUTIONS[grid.id], ranks=ranks)
    assert all(item.passed for item in items), "\n".join(map(item_line, items))


@pytest.mark.parametrize("jobs", [2, 3])
def test_parallel_grading_blames_a_change_only_on_the_submissions_that_could_have_made_it(tmp_path, jobs):
    guarded = tmp_path / "grader"
    guarded.mkdir()
    (guarded / "checks.py").write_text("original")
    guard = FileGuard([guarded])
    a_started, tampered = threading.Event(), threading.Event()
    graded_alone: list[str] = []
    recorded: dict[str, list[str]] = {}

    def grade_one(name: str) -> str:
        if not threading.current_thread().name.startswith("grade"):  # the second, one-at-a-time pass
            graded_alone.append(name)
            if name == "b":
                (guarded / "checks.py").write_text("tampered")
        elif name == "a":  # finishes (and finds the change) while b still runs
            a_started.set()
            tampered.wait(5)
        elif name == "b":
            a_started.wait(5)
            (guarded / "checks.py").write_text("tampered")
            tampered.set()
            deadline = time.monotonic() + 5
            while (guarded / "checks.py").read_text() != "original" and time.monotonic() < deadline:
                time.sleep(0.01)  # until a's end has put the file back
        return f"graded {name}"

    def record(name: str, graded: str, touched: list[str]) -> None:
        recorded[name] = touched
        (guarded / f"{name}.result").write_text(graded)  # the grader's own write: never blamed

    grade_in_parallel(list("abcd"), grade_one, guard, record, jobs)
    assert (guarded / "checks.py").read_text() == "original"
    assert sorted(recorded) == list("abcd")
    # a found the change but could not tell who made it: a and b were graded again, alone (with 3
    # jobs c ran beside them, and is graded again if it was still running or found the change first).
    if jobs == 2:
        assert graded_alone == ["a", "b"]
    else:
        assert graded_alone in (["a", "b"], ["a", "b", "c"])
    assert recorded["b"] and all(recorded[n] == [] for n in "acd")


def test_a_check_leaves_no_process_behind():
    # cl.check in a notebook: the set starts its own rank server and ends it, with every rank, when done.
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ring = exercise("01.ring_allreduce")
    items = check_exercise(ring, RAISES_ON_TWO_RANKS)  # one failed run (ranks restarted), one that passes
    assert [item.passed for item in items] == [False] * len(ring.runs[0].items) + [True] * len(ring.runs[1].items)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], [(p.pid, p.cmdline()) for p in left]


# Correct, but slow: each call computes for 0.8 deadlines of wall time; a run makes two calls (int64, float32).
SLOW_BUT_RIGHT = answers.ALLGATHER_SOLUTION.replace(
    "    gathered = []\n",
    "    import time\n    end = time.monotonic() + 0.8 * DEADLINE_S\n    while time.monotonic() < end:\n"
    "        sum(range(1000))\n    gathered = []\n", 1)
# Blocked, not computing (as a rank waiting in a collective is): every rank sleeps past the deadline.
BLOCKED = answers.ALLGATHER_SOLUTION.replace(
    "    gathered = []\n", "    import time\n    time.sleep(60)\n    gathered = []\n", 1)
DEADLINE_S = 3.0


@pytest.mark.slow
def test_a_deadline_waits_for_ranks_still_computing_but_not_for_blocked_ones():
    # A loaded machine makes a correct answer slow: the deadline is extended while the ranks use CPU
    # (at most twice). Ranks blocked in a collective use none: the hang is reported at the first deadline.
    from course_lib.grading.spec import Limits

    found = exercise("01.allgather_from_broadcast")
    limits = Limits(run_timeout_s=DEADLINE_S)
    slow = check_exercise(found, SLOW_BUT_RIGHT.replace("DEADLINE_S", repr(DEADLINE_S)), limits=limits)
    assert all(item.passed for item in slow), "\n".join(map(item_line, slow))
    started = time.monotonic()
    blocked = check_exercise(found, BLOCKED, limits=limits)
    took = time.monotonic() - started
    assert not any(item.passed for item in blocked)
    assert blocked[0].message.startswith("did not finish within 3 s"), blocked[0].message
    # One deadline plus the grader's own start and stop, not three deadlines.
    assert took < 3 * DEADLINE_S + 10, took



def test_a_rank_past_its_cpu_time_gets_sigxcpu_which_the_checker_names_not_sigkill():
    """A rank's limits as the rank runner sets them: RLIMIT_CPU's soft limit (SIGXCPU, named for CPU time)
    comes before its hard one (SIGKILL, which would read like the memory killer)."""
    spin = ("from course_lib.grading.rank_runner import _apply_limits\n"
            "_apply_limits({'cpu_s': 1, 'memory_bytes': 2**33, 'file_bytes': 2**20})\n"
            "while True:\n    pass\n")
    done = subprocess.run([sys.executable, "-c", spin], cwd=ROOT, timeout=120)
    assert done.returncode == -signal.SIGXCPU
