"""The grader CLI (`python -m course_lib.grade`) on real submissions: Gradescope results.json, the
CSV, hidden checks, resuming, and submissions that hang, crash, exit, flood their output, tamper
with the grader's files or try to get around the exercise's rules. None stalls grading, none
earns points it should not, and no process outlives the grading."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import nbformat
import pytest

import grading_answers as answers
from exercise_checks import assert_deadline_message
from proc_helpers import MARK_VAR, describe, kill_quietly, marked_processes, new_mark, still_alive

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # the CLI in subprocesses, submissions that hang to their deadlines
EXERCISES = ROOT / "exercises" / "01_process_groups_exercises.ipynb"
RING = "01.ring_allreduce"
RUN_TIMEOUT_S = 6  # a healthy run takes under 1 s here (ranks are started before its deadline counts)
RING_POINTS = 4

HEADER = "%%exercise 01.ring_allreduce\nimport os, sys, time\nimport torch\nimport torch.distributed as dist\n\n\n"

SUBMISSIONS = {
    "a_good": answers.RING_SOLUTION,
    "b_hangs": HEADER + "def ring_allreduce(tensor):\n    time.sleep(600)\n",
    "c_raises": HEADER + "def ring_allreduce(tensor):\n    raise ValueError('my bug')\n",
    "d_exits": HEADER + "def ring_allreduce(tensor):\n    os._exit(1)\n",
    "e_floods": HEADER + "def ring_allreduce(tensor):\n    while True:\n        print('x' * 1000)\n",
    # Uses the C++ group method directly, bypassing dist.all_reduce.
    "f_bypasses": HEADER + "def ring_allreduce(tensor):\n"
                           "    dist.distributed_c10d._get_default_group().allreduce([tensor]).wait()\n",
    # Sums with the dispatcher op, then sends one element for show, so the ledger has a send.
    "g2_fakes_sends": HEADER + "import torch.distributed.distributed_c10d as c10d\n"
                               "def ring_allreduce(tensor):\n"
                               "    group = c10d._get_default_group().boxed()\n"
                               "    torch.ops.c10d.allreduce_([tensor], group, torch.classes.c10d.ReduceOp(),\n"
                               "                              None, False, -1)[1].wait()\n"
                               "    rank, world = dist.get_rank(), dist.get_world_size()\n"
                               "    one = torch.zeros(1, dtype=tensor.dtype)\n"
                               "    for step in ((0, 1) if rank % 2 == 0 else (1, 0)):\n"
                               "        if step == 0:\n"
                               "            dist.send(one, (rank + 1) % world)\n"
                               "        else:\n"
                               "            dist.recv(one, (rank - 1) % world)\n",
    # Asks for 8 GiB: over the memory limit (4 GiB), so the allocation fails at once.
    "g3_hogs_memory": HEADER + "def ring_allreduce(tensor):\n    torch.empty(2**31)\n",
    # Reserves 64 GiB of address space it never uses (PROT_NONE), as a CUDA build of torch does:
    # not memory, so it grades like the plain solution.
    "g4_reserves_address_space": answers.RING_SOLUTION + "\nimport mmap\n_reserved = mmap.mmap(-1, 64 << 30, "
                                 "flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)\n",
    # Goes below torch.distributed to the dispatcher op, which nothing in Python can block:
    # the ledger shows no send, so the sums cannot have come from a ring.
    "g_dispatcher_op": HEADER + "import torch.distributed.distributed_c10d as c10d\n"
                                "def ring_allreduce(tensor):\n"
                                "    group = c10d._get_default_group().boxed()\n"
                                "    torch.ops.c10d.allreduce_([tensor], group, torch.classes.c10d.ReduceOp(),\n"
                                "                              None, False, -1)[1].wait()\n",
}


def _notebook_with(ring_cell: str) -> nbformat.NotebookNode:
    nb = nbformat.read(EXERCISES, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith(f"%%exercise {RING}"):
            cell.source = ring_cell
    return nb


def _write(folder: pathlib.Path, name: str, ring_cell: str) -> pathlib.Path:
    path = folder / f"{name}.ipynb"
    nbformat.write(_notebook_with(ring_cell), path)
    return path


def _grade(*args: str, env_mark: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, MARK_VAR: env_mark}
    return subprocess.run([sys.executable, "-m", "course_lib.grade", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=ROOT)


def _nothing_left(mark: str) -> None:
    left = still_alive(marked_processes(mark), timeout_s=5)
    kill_quietly(left)
    assert left == [], describe(left)


def _tests(result: dict) -> dict[str, dict]:
    return {t["name"].split(": ", 1)[1]: t for t in result["tests"]}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """All SUBMISSIONS graded in one CLI call (ring exercise only), plus a tampering one."""
    folder = tmp_path_factory.mktemp("submissions")
    out = tmp_path_factory.mktemp("grades")
    hidden = tmp_path_factory.mktemp("hidden")
    (hidden / "ring_small.py").write_text(HIDDEN_CHECKS)
    paths = [_write(folder, name, source) for name, source in SUBMISSIONS.items()]
    # Last: overwrites the results of the first submission, the CSV and the hidden checks.
    paths.append(_write(folder, "h_tampers", HEADER + TAMPERING.format(out=str(out), hidden=str(hidden))))
    mark = new_mark()
    started = time.monotonic()
    proc = _grade(*map(str, paths), "--out", str(out), "--hidden", str(hidden), "--exercises", RING,
                  "--run-timeout", str(RUN_TIMEOUT_S), env_mark=mark)
    elapsed = time.monotonic() - started
    _nothing_left(mark)
    results = {p.name: json.loads((p / "results.json").read_text()) for p in out.iterdir() if p.is_dir()}
    return proc, elapsed, out, hidden, results


HIDDEN_CHECKS = '''
from course_lib.grading.lessons.lesson01.common import _integer_tensors
from course_lib.grading.lessons.lesson01.ring_allreduce import _ring_sums
from course_lib.grading.spec import Item, RunSpec

# SENTINEL-7f3a: must never reach a learner's process.
HIDDEN_RUNS = {"01.ring_allreduce": [
    RunSpec(3, lambda n: _integer_tensors(n, [(9,)], seed=999), (Item("sums on 3 ranks", 1, _ring_sums()),)),
]}
'''

TAMPERING = '''import pathlib

def ring_allreduce(tensor):
    out, hidden = pathlib.Path({out!r}), pathlib.Path({hidden!r})
    (out / "a_good" / "results.json").write_text('{{"score": 0, "tests": []}}')
    (out / "grades.csv").write_text("submission,score\\nh_tampers,1000\\n")
    (out / "b_hangs" / "results.json").unlink()
    (hidden / "ring_small.py").write_text("HIDDEN_RUNS = {{}}\\n")
    (out / "i_not_yet_graded").mkdir(exist_ok=True)
    tensor.mul_(dist.get_world_size())  # and a wrong answer that cannot pass anyway
'''


def test_cli_succeeds_and_reports_every_submission(graded):
    proc, _, out, _, results = graded
    assert proc.returncode == 0, proc.stderr
    assert sorted(results) == sorted([*SUBMISSIONS, "h_tampers"])
    assert f"a_good: {RING_POINTS + 1:g}/{RING_POINTS + 1:g}" in proc.stdout
    # The progress bar (stderr is not a terminal: one line per submission).
    assert proc.stderr.count("] ") == len(results)


def test_results_json_is_gradescope_format_with_hidden_checks_after_publication(graded):
    result = graded[4]["a_good"]
    assert set(result) >= {"score", "tests", "output"}
    assert result["score"] == RING_POINTS + 1
    for test in result["tests"]:
        assert set(test) >= {"name", "score", "max_score", "output", "visibility"}
    visibility = {name: t["visibility"] for name, t in _tests(result).items()}
    assert visibility["sums on 3 ranks"] == "after_published"
    assert set(visibility.values()) == {"visible", "after_published"}


def test_csv_has_one_row_per_submission(graded):
    out, results = graded[2], graded[4]
    lines = (out / "grades.csv").read_text().splitlines()
    assert lines[0] == f"submission,score,max_score,{RING}"
    rows = {line.split(",")[0]: line.split(",")[1:] for line in lines[1:]}
    assert sorted(rows) == sorted(results)
    assert rows["a_good"] == ["5", "5", "5"]


def test_a_submission_without_the_exercise_cell_scores_zero_saying_which_cell_is_missing(tmp_path):
    from course_lib.grading.grader import grade_submission
    from course_lib.grading.spec import Limits

    nb = nbformat.read(EXERCISES, as_version=4)
    nb.cells = [c for c in nb.cells if not c.source.startswith(f"%%exercise {RING}")]
    path = tmp_path / "01_process_groups.ipynb"
    nbformat.write(nb, path)
    graded, note = grade_submission(path, [RING], {}, Limits())
    assert list(graded) == [RING] and note == ""
    assert [(item.score, item.message) for item in graded[RING]] == \
        [(0.0, f"no answer: the notebook has no cell that starts with %%exercise {RING}")] * RING_POINTS


def test_hanging_submission_scores_zero_within_its_deadlines(graded):
    _, elapsed, _, _, results = graded
    tests = _tests(results["b_hangs"])
    assert results["b_hangs"]["score"] == 0
    first, *others = tests.values()  # the first run hangs: its diagnosis is said once, the later runs skipped
    assert f"did not finish within {RUN_TIMEOUT_S} s" in first["output"]
    assert "running Python at cell line 8" in tests["sums float32 tensors on 2 ranks"]["output"]
    assert all(t["output"].startswith(("the same run as ", "not run: an earlier run did not finish")) for t in others)
    # 1 run stopped at the deadline, 8 more submissions of ~3 launches each: well under 10 min.
    assert elapsed < (RUN_TIMEOUT_S + 5) + 8 * 3 * 15


@pytest.mark.parametrize("name, phrase", [
    ("c_raises", "rank 0 raised at cell line 8: ValueError: my bug"),
    ("d_exits", "exited with code 1"),
    ("e_floods", "File too large (a rank may write at most 16 MiB: print less)"),
    ("f_bypasses", "ProcessGroup.allreduce is not allowed here"),
    ("g_dispatcher_op", "no isend or send call was recorded"),
    ("g2_fakes_sends", "sent only 4 B of a 40 B tensor with send/isend"),
    ("g3_hogs_memory", "can't allocate memory"),
    ("g3_hogs_memory", "(memory limit: a rank may use at most 4 GiB)"),
])
def test_failing_submissions_score_zero_with_a_reason(graded, name, phrase):
    result = graded[4][name]
    assert result["score"] == 0
    first = result["tests"][0]["output"]
    assert phrase in first, first


def test_reserved_address_space_is_not_memory(graded):
    results = graded[4]
    assert results["g4_reserves_address_space"]["score"] == results["a_good"]["score"] > 0


def test_flooding_submission_keeps_results_small(graded):
    out = graded[2]
    assert (out / "e_floods" / "results.json").stat().st_size < 100_000


def test_tampering_is_undone_and_scores_zero(graded):
    _, _, out, hidden, results = graded
    assert results["h_tampers"]["score"] == 0
    assert "changed the grader's files" in results["h_tampers"]["output"]
    assert results["a_good"]["score"] == RING_POINTS + 1  # read back from disk after the tampering
    assert (out / "b_hangs" / "results.json").exists()
    assert "SENTINEL-7f3a" in (hidden / "ring_small.py").read_text()
    assert not (out / "i_not_yet_graded").exists()
    csv_rows = (out / "grades.csv").read_text()
    assert "1000" not in csv_rows


def test_second_run_keeps_every_result_without_launching(graded, tmp_path):
    proc, _, out, hidden, results = graded
    paths = sorted(str(p) for p in pathlib.Path(proc.args[3]).parent.glob("*.ipynb"))
    started = time.monotonic()
    again = _grade(*paths, "--out", str(out), "--hidden", str(hidden), "--exercises", RING,
                   "--run-timeout", str(RUN_TIMEOUT_S), env_mark=new_mark())
    assert again.returncode == 0, again.stderr
    assert again.stderr.count(": kept") == len(results)
    assert time.monotonic() - started < 20


def test_learner_process_sees_no_expected_values_or_hidden_checks(tmp_path):
    # The submission prints everything it can find next to it: its job folder and environment.
    spy = HEADER + (
        "def ring_allreduce(tensor):\n"
        "    job = os.path.dirname(os.getcwd())\n"
        "    for name in sorted(os.listdir(job)):\n"
        "        path = os.path.join(job, name)\n"
        "        print(name, open(path, errors='replace').read() if os.path.isfile(path) else '')\n"
        "    print(sorted(os.environ.items()))\n"
    )
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "ring_small.py").write_text(HIDDEN_CHECKS)
    out = tmp_path / "out"
    mark = new_mark()
    proc = _grade(str(_write(tmp_path, "spy", spy)), "--out", str(out), "--hidden", str(hidden),
                  "--exercises", RING, "--run-timeout", str(RUN_TIMEOUT_S), env_mark=mark)
    _nothing_left(mark)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "spy" / "results.json").read_text())
    printed = "\n".join(t["output"] for t in result["tests"])
    assert "job.json" in printed and "submission.py" in printed  # the spy did look
    assert "inputs.rank" not in printed  # inputs were deleted before the learner's code ran
    assert "SENTINEL-7f3a" not in printed and str(hidden) not in printed
    assert "expected" not in printed.replace("expected a", "")


def test_killed_grader_resumes_without_losing_results(tmp_path):
    paths = [_write(tmp_path, f"s{i}", answers.RING_SOLUTION) for i in range(3)]
    out = tmp_path / "out"
    mark = new_mark()
    env = {**os.environ, MARK_VAR: mark}
    args = [sys.executable, "-m", "course_lib.grade", *map(str, paths), "--out", str(out), "--exercises", RING]
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "s0" / "results.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # mid-way, possibly while s1's ranks run
    proc.wait()
    _nothing_left(mark)  # the launch's watchdog ends ranks whose grader died
    first = json.loads((out / "s0" / "results.json").read_text())
    assert first["score"] == RING_POINTS
    assert not (out / "s2" / "results.json").exists()
    again = _grade(*map(str, paths), "--out", str(out), "--exercises", RING, env_mark=new_mark())
    assert again.returncode == 0, again.stderr
    assert "s0: kept" in again.stderr and "s1: kept" not in again.stderr
    rows = (out / "grades.csv").read_text().splitlines()[1:]
    assert rows == [f"s{i},{RING_POINTS},{RING_POINTS},{RING_POINTS}" for i in range(3)]


def test_jobs_2_grades_two_at_a_time_and_still_blames_the_tampering_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    names = ["p1_good", "p2_tampers", "p3_good"]
    tamper = HEADER + "import pathlib\n\ndef ring_allreduce(tensor):\n" \
                      f"    pathlib.Path({str(out / 'planted.txt')!r}).write_text('x')\n"
    paths = [_write(tmp_path, names[0], answers.RING_SOLUTION), _write(tmp_path, names[1], tamper),
             _write(tmp_path, names[2], answers.RING_SOLUTION)]
    mark = new_mark()
    proc = _grade(*map(str, paths), "--out", str(out), "--exercises", RING, "--jobs", "2",
                  "--run-timeout", str(RUN_TIMEOUT_S), env_mark=mark)
    _nothing_left(mark)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:3] == [f"p1_good: {RING_POINTS}/{RING_POINTS}",
                                            f"p2_tampers: 0/{RING_POINTS}", f"p3_good: {RING_POINTS}/{RING_POINTS}"]
    tampered = json.loads((out / "p2_tampers" / "results.json").read_text())
    assert "changed the grader's files" in tampered["output"]
    assert not (out / "planted.txt").exists()


@pytest.mark.parametrize("args, message", [
    (["exercises", "--jobs", "0"], "error: --jobs must be at least 1, got 0"),
    (["missing.ipynb"], "error: no such submission file or folder: missing.ipynb"),
    (["exercises", "--exercises", "01.nope"], "error: no exercise '01.nope'; known: "),
    (["exercises", "--hidden", "no_such_dir"], "error: hidden checks folder not found: no_such_dir"),
    (["exercises", "solutions", "--results-json", "r.json"], "error: --results-json needs exactly one submission"),
])
def test_bad_input_is_one_line(args, message):
    proc = _grade(*args, env_mark=new_mark(), timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


def test_the_exercise_catalog_is_built_once_and_read_only():
    from course_lib.grading import registry

    registry.public_exercises.cache_clear()
    for exercise_id in registry.public_exercises():
        registry.exercise(exercise_id)
    registry.exercises_of_lesson("01")
    assert registry.public_exercises.cache_info().misses == 1
    with pytest.raises(TypeError):
        registry.public_exercises()["01.new"] = None


def test_a_check_stops_at_the_first_run_that_hangs_and_says_its_diagnosis_once():
    from course_lib.grading.checker import check_exercise
    from course_lib.grading.registry import exercise
    from course_lib.grading.spec import Limits

    ring = exercise(RING)
    assert len(ring.runs) >= 2
    started = time.monotonic()
    items = check_exercise(ring, answers.RING_RANK_1_RETURNS, limits=Limits(run_timeout_s=4))
    elapsed = time.monotonic() - started
    first_run = len(ring.runs[0].items)
    assert_deadline_message(items[0].message, 4, 2)
    assert all(i.message == f'the same run as "{items[0].name}": it did not finish' for i in items[1:first_run])
    assert all(i.message.startswith("not run: an earlier run did not finish") for i in items[first_run:])
    assert sum(i.score for i in items) == 0 and len(items) == sum(len(run.items) for run in ring.runs)
    assert elapsed < 4 + 20, elapsed  # one deadline, not one per run


def test_a_gloo_abort_says_what_gloo_said_and_a_deadline_with_no_waiting_rank_may_be_a_busy_machine():
    from course_lib.grading.checker import _gloo_abort, _maybe_busy

    lines = ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
             "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. "
             "16 vs 4. Received data size doesn't match expected size"]
    said = _gloo_abort(lines)
    assert "16 vs 4. Received data size doesn't match expected size" in said and "enforce fail" not in said
    assert "16 bytes arrived where the receiver expected 4" in said
    assert "the ranks' calls do not match" in said and _gloo_abort(["Aborted"]) == ""
    assert "the machine may have been busy" in _maybe_busy(["ranks 0, 1 are still in your function: they are "
                                                           "running Python at cell line 4, before any collective"])
    assert _maybe_busy(["rank 0 is still in your function: it is waiting in recv #1 (40 B, world group)"]) == ""


def test_a_gloo_transfer_timeout_is_one_sentence_without_gloo_source_path():
    from course_lib.grading.checker import _gloo_timeout

    raw = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
           "Timed out waiting 50000ms for recv operation to complete")
    said = _gloo_timeout(raw)
    assert said.startswith("RuntimeError: a receive never completed in the process group's 50 s: ")
    assert "was every transfer waited for" in said and "unbound_buffer" not in said and "__w" not in said
    assert "a send never completed" in _gloo_timeout(raw.replace("for recv", "for send"))
    assert _gloo_timeout("RuntimeError: shapes differ") == "RuntimeError: shapes differ"
