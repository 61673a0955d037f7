"""Grades as files: Gradescope's results.json per submission and one CSV over all, written atomically.

results.json follows Gradescope's autograder format: `score`, `output`, and
`tests` with `name`, `score`, `max_score`, `output`, `visibility`; our own
bookkeeping (which file, its hash, which hidden checks) goes in `extra_data`.
"""

from __future__ import annotations

import csv
import io
import os
import pathlib

from .spec import ItemResult

__all__ = ["results_json", "write_atomically", "write_csv"]


def results_json(exercise_items: dict[str, list[ItemResult]], *, extra: dict, note: str = "",
                 hints: dict[str, str] | None = None) -> dict:
    """The results.json content for one submission: one test per item, named '<exercise id>: <item>'.

    `hints`: {exercise id: hint}; an exercise that lost points gets its hint in the output of its first
    failed test, not repeated in each.
    """
    tests = []
    for exercise_id, items in exercise_items.items():
        hint = (hints or {}).get(exercise_id, "")
        for item in items:
            output = item.message or "passed"
            if hint and not item.passed:
                output += f"\nhint: {hint}"
                hint = ""
            if item.output:
                output += "\n\nwhat the ranks printed:\n" + item.output
            tests.append({
                "name": f"{exercise_id}: {item.name}",
                "score": item.score,
                "max_score": item.max_score,
                "output": output,
                # Hidden checks: learners see them once the instructor publishes grades.
                "visibility": "after_published" if item.hidden else "visible",
            })
    score = sum(t["score"] for t in tests)
    max_score = sum(t["max_score"] for t in tests)
    summary = f"{score:g}/{max_score:g} points" + (f"\n{note}" if note else "")
    return {"score": score, "output": summary, "tests": tests, "extra_data": {**extra, "max_score": max_score}}


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or a crash) sees the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_csv(path: pathlib.Path, results: dict[str, dict]) -> None:
    """One row per submission: name, total, maximum, then the points of each exercise."""
    exercise_ids = sorted({t["name"].split(":", 1)[0] for r in results.values() for t in r["tests"]})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["submission", "score", "max_score", *exercise_ids])
    for name in sorted(results):
        result = results[name]
        per_exercise = {i: 0.0 for i in exercise_ids}
        for test in result["tests"]:
            per_exercise[test["name"].split(":", 1)[0]] += test["score"]
        writer.writerow([name, f"{result['score']:g}", f"{result['extra_data']['max_score']:g}",
                         *(f"{per_exercise[i]:g}" for i in exercise_ids)])
    write_atomically(path, out.getvalue())
