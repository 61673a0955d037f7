"""Exercises and autograding: learners' functions run on real ranks, judged against references.

- `%%exercise 01.ring_allreduce` (a cell magic) saves the learner's answer cell;
  `cl.check("01.ring_allreduce")` runs that exercise's public checks on it.
- `python -m course_lib.grade SUBMISSIONS... [--hidden DIR] [--out DIR]` grades
  notebooks (Gradescope results.json per submission, one CSV over all).
- `python -m course_lib.grading.authoring` writes exercises/ from solutions/.

Modules: spec (what an exercise is), lessons/lessonNN/ (one lesson's exercises in one place:
`exercises` holds specs, references and judges, `drivers` what runs on the ranks), drivers
(finding a lesson's driver) + rank_runner (on the ranks), rank_set (the ranks of one submission,
started once, reused run after run), stuck (who waits where at a deadline, yours or the
checker's), checker (run and judge), registry (public
and hidden checks), cells (finding answers), check (`cl.check`), report, grader
(the CLI behind `python -m course_lib.grade`), parallel (`--jobs N`). The `%%exercise` magic is in
course_lib/magics/exercise_magic.py.
"""

from __future__ import annotations

__all__ = ["check"]


def check(exercise_id: str):
    """Run `exercise_id`'s public checks on the last `%%exercise` cell of that id; print the report."""
    from .check import check as _check

    return _check(exercise_id)
