"""How fast the grader gets through a class: submissions per minute with `--jobs 1` and `--jobs 2`.

    .venv/bin/python bench/bench_grading.py [--submissions 8] [--rounds 3] [--smoke]

Run it from the repository root. Goal (issue 12): <= 8 s per submission of
lesson 01 (11 checks in 5 runs on 2, 3 and 4 ranks). Each round grades the same
folder of submissions as an instructor would, `python -m course_lib.grade
FOLDER --force`, once per `--jobs` value, in a new random order every round.
The folder holds copies of solutions/01_process_groups_solutions.ipynb (full marks) and,
one in four, of exercises/01_process_groups_exercises.ipynb (the unfinished stubs: every
run fails, so the grader restarts its ranks after each). Times are wall clock
for the whole command, so they include starting the grader (importing torch
twice: the grader and the server its ranks are forked from).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "01_process_groups_solutions.ipynb"
STUBS = ROOT / "exercises" / "01_process_groups_exercises.ipynb"


def _class_folder(folder: pathlib.Path, count: int) -> None:
    for i in range(count):
        source = STUBS if i % 4 == 3 else SOLUTION
        shutil.copy(source, folder / f"learner{i:03d}_01_process_groups.ipynb")


def _grade(folder: pathlib.Path, out: pathlib.Path, jobs: int) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "course_lib.grade", str(folder), "--exercises", "01",
                           "--out", str(out), "--force", "--jobs", str(jobs)],
                          cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the grader failed:\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--smoke", action="store_true", help="2 submissions, 1 round: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.submissions, args.rounds = 2, 1

    with tempfile.TemporaryDirectory(prefix="bench_grading_") as tmp:
        folder = pathlib.Path(tmp) / "class"
        folder.mkdir()
        _class_folder(folder, args.submissions)
        stubs = sum(1 for i in range(args.submissions) if i % 4 == 3)
        print(f"{args.submissions} submissions of lesson 01 ({stubs} unfinished), {args.rounds} round(s), "
              f"--jobs {' and '.join(map(str, args.jobs))}")
        times: dict[int, list[float]] = {jobs: [] for jobs in args.jobs}
        for _ in range(args.rounds):
            order = list(args.jobs)
            random.shuffle(order)
            for jobs in order:
                times[jobs].append(_grade(folder, pathlib.Path(tmp) / f"out{jobs}", jobs))

    reference = statistics.median(times[args.jobs[0]])
    print(f"\n{'':10} {'median s':>9} {'s/submission':>13} {'submissions/min':>16} {'ratio':>6}")
    for jobs, samples in times.items():
        median = statistics.median(samples)
        print(f"--jobs {jobs:<3} {median:9.1f} {median / args.submissions:13.2f} "
              f"{60 * args.submissions / median:16.1f} {median / reference:6.2f}")
    worst = max(statistics.median(s) for s in times.values()) / args.submissions
    print(f"\ngoal <= 8 s per submission: {'met' if worst <= 8 else 'NOT met'} (slowest: {worst:.2f} s)")


if __name__ == "__main__":
    main()
