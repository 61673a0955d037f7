"""Where exercises come from: the public ones shipped here, plus instructor-only runs from a folder.

A hidden-checks folder holds Python files, each defining

    HIDDEN_RUNS = {"01.ring_allreduce": [RunSpec(...), ...], ...}

with new inputs and judges for public exercises (the drivers that run on the
ranks stay the public ones). Only the grader's process imports these files;
nothing from them reaches a learner's ranks except the inputs of their cases.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import pathlib
import types

from .spec import Exercise, RunSpec

LESSONS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10")  # each has course_lib/grading/lessons/lessonNN/

__all__ = ["UnknownExercise", "exercise", "exercises_of_lesson", "load_hidden", "public_exercises"]


class UnknownExercise(KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


@functools.cache
def public_exercises() -> types.MappingProxyType:
    """{id: Exercise} of every lesson, built once per process (read-only: shared by every lookup)."""
    found: dict[str, Exercise] = {}
    for lesson in LESSONS:
        found.update(importlib.import_module(f"{__package__}.lessons.lesson{lesson}.exercises").EXERCISES)
    return types.MappingProxyType(found)


def load_hidden(directory: str | pathlib.Path) -> dict[str, tuple[RunSpec, ...]]:
    """{exercise id: hidden runs} from every *.py file in `directory` (sorted by name)."""
    folder = pathlib.Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"hidden checks folder not found: {folder}")
    known = public_exercises()
    runs: dict[str, tuple[RunSpec, ...]] = {}
    for path in sorted(folder.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"course_hidden_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for exercise_id, extra in getattr(module, "HIDDEN_RUNS", {}).items():
            if exercise_id not in known:
                raise UnknownExercise(f"{path.name}: HIDDEN_RUNS names an unknown exercise {exercise_id!r}")
            hidden = tuple(dataclasses.replace(run, hidden=True) for run in extra)
            runs[exercise_id] = runs.get(exercise_id, ()) + hidden
    return runs


def exercise(exercise_id: str, hidden: dict[str, tuple[RunSpec, ...]] | None = None) -> Exercise:
    """The exercise `exercise_id`, with its hidden runs appended if given."""
    known = public_exercises()
    if exercise_id not in known:
        raise UnknownExercise(f"no exercise {exercise_id!r}; known: {', '.join(sorted(known))}")
    found = known[exercise_id]
    return found.with_runs(hidden.get(exercise_id, ())) if hidden else found


def exercises_of_lesson(lesson: str) -> list[str]:
    """Ids of lesson `lesson` ("01"), in the order they are defined."""
    return [i for i in public_exercises() if i.split(".")[0] == lesson]
