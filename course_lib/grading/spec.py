"""What an exercise is: the function to write, the runs that exercise it, and how each is judged.

An `Exercise` names the learner's function and the torch.distributed calls it
may make. Each `RunSpec` is one real torchrun launch on `nproc` gloo ranks: the
checker makes every case's inputs (in its own process, seeded), the ranks call
the learner's function through the exercise's `driver`, and each `Item` judges
what came back (outputs and collective ledgers) against a reference the
checker computes itself. A run that crashes or hangs scores 0 on all its items.

Drivers run on the ranks, inside the learner's process, so they live in this
public package; judges and references run only in the checker's process, so
hidden (instructor) checks can add runs with new inputs and judges without
anything secret reaching the learner's code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["CaseResult", "Exercise", "Item", "ItemResult", "Limits", "RunOutcome", "RunSpec"]


@dataclasses.dataclass
class CaseResult:
    """What one case produced on one rank: the driver's return value and its ledger entries."""

    output: Any
    ledger: list[dict]  # the rank's collectives made while the learner's function ran on this case


@dataclasses.dataclass
class RunOutcome:
    """Everything a judge may look at for one run: inputs[case][rank] and results[case][rank]."""

    nproc: int
    inputs: list[dict[int, tuple]]
    results: list[dict[int, CaseResult]]


# A judge returns the problems it found (each a short sentence naming the rank
# and the value); an empty list means the item passes.
Judge = Callable[[RunOutcome], list[str]]


@dataclasses.dataclass(frozen=True)
class Item:
    """One scored line of the report."""

    name: str
    points: float
    judge: Judge


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One launch: `make_inputs(nproc)` -> [case: {rank: args}], then its items are judged."""

    nproc: int
    make_inputs: Callable[[int], list[dict[int, tuple]]]
    items: tuple[Item, ...]
    timeout_s: float = 20.0  # a healthy 4-rank run takes 4-5 s here (launch included)
    hidden: bool = False  # instructor-only: reported to learners only after grades are published


@dataclasses.dataclass(frozen=True)
class Exercise:
    """An exercise: `function` is what the learner's `%%exercise <id>` cell must define."""

    id: str
    function: str
    signature: str  # as shown to the learner, e.g. "ring_allreduce(tensor: torch.Tensor) -> None"
    driver: str  # name of a function in the lesson's drivers (lessons/lessonNN/drivers.py), run on every rank per case
    runs: tuple[RunSpec, ...]
    allowed_ops: frozenset[str] | None = None  # torch.distributed calls allowed; None: any
    # Calls each rank must be seen making (ledger) in every case, or nothing scores: an answer
    # cannot have come from messages that were never sent.
    required_ops: frozenset[str] = frozenset()
    # Modules the grading ranks' server imports before it forks them, so that no run's deadline pays
    # for them: DDP's constructor imports torch._dynamo (about 1 s a process alone, 4 s with 3 ranks
    # importing at once on 2 cores).
    preload: tuple[str, ...] = ()
    # What the check says after a failure, one level per failed check in a kernel: the lesson's
    # section, then the API, then the approach; never the code. A stub holds no hint (authoring.py).
    hints: tuple[str, ...] = ()

    @property
    def points(self) -> float:
        return sum(item.points for run in self.runs for item in run.items)

    def with_runs(self, extra: tuple[RunSpec, ...]) -> Exercise:
        """This exercise with more (hidden) runs appended."""
        return dataclasses.replace(self, runs=self.runs + tuple(extra))


@dataclasses.dataclass(frozen=True)
class Limits:
    """What each rank of a check may use (see rank_runner)."""

    memory_bytes: int = 4 << 30  # data segment (RLIMIT_DATA); torch + gloo on CPU use about 0.25 GiB of it
    file_bytes: int = 16 << 20  # per file written, which includes the rank's output log
    run_timeout_s: float | None = None  # replaces every run's own deadline (slow machines, tests)


@dataclasses.dataclass
class ItemResult:
    name: str
    score: float
    max_score: float
    message: str = ""  # why it lost points, naming the rank and value; empty when it passed
    output: str = ""  # what the ranks printed (trimmed), for the learner
    hidden: bool = False

    @property
    def passed(self) -> bool:
        return self.score == self.max_score
