"""How a rank calls the learner's function for one case, and what it sends back to the checker.

Runs on the ranks, in the learner's process. A driver copies the inputs it
passes (so a function that modifies its argument cannot touch the checker's
view of the inputs) and returns plain data: tensors, lists, dicts, numbers,
strings. That is all `torch.load(weights_only=True)` accepts on the checker's
side, so nothing the learner's code builds is ever unpickled by the grader.
A return value of the wrong type is described in words, for the judge to report.

Each lesson's drivers live beside its judges, in `lessons/lessonNN/drivers.py`;
`Exercise.driver` names a function there.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable

__all__ = ["describe", "driver_for", "drivers_module", "rank_device", "refused"]


def rank_device():
    """The device this rank's models, batches and meshes go to: its current GPU under NCCL (which serves CUDA
    tensors only), else the CPU (the grader's ranks always run gloo). What a driver sends back goes to the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def describe(value: Any) -> str:
    """A value the learner returned, in words (its type), for a judge to report."""
    return f"{type(value).__name__}"


def drivers_module(exercise_id: str) -> str:
    """The module holding the drivers of `exercise_id`'s lesson: "02.x" -> course_lib.grading.lessons.lesson02.drivers."""
    return f"{__package__}.lessons.lesson{exercise_id.split('.', 1)[0]}.drivers"


def driver_for(exercise_id: str, name: str) -> Callable[..., Any]:
    """The driver function `name` of `exercise_id`'s lesson (imported on first use)."""
    return getattr(importlib.import_module(drivers_module(exercise_id)), name)


@contextlib.contextmanager
def refused(*targets: tuple[str, str, str]):
    """While inside, each (module, dotted name, name shown) raises a one-line RuntimeError: the exercise is to
    build what it does. A class's `__init__` is replaced; a function's code is swapped (not its name), so a
    name the learner's cell imported before the call is refused too. Everything is put back on the way out."""
    undo = []
    for module, name, shown in targets:
        found = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
        message = f"{shown} is what this exercise asks you to build: it is not allowed here"
        scope: dict = {}
        exec(f"def refuse(*args, **kwargs):\n    raise RuntimeError({message!r})", scope)  # no closure: code swaps
        if inspect.isclass(found):
            undo.append((found, "__init__", found.__dict__.get("__init__")))
            found.__init__ = scope["refuse"]
        else:
            inner = inspect.unwrap(found)
            undo.append((inner, "__code__", inner.__code__))
            inner.__code__ = scope["refuse"].__code__
    try:
        yield
    finally:
        for owner, attribute, original in reversed(undo):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
