"""What a prediction is: how to measure its answer, the formula it must equal, how close counts."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

__all__ = ["Prediction", "Tolerance"]

# results: cl.results ({name: {rank: value}}); ledgers: cl.ledgers ({rank: [entry, ...]}).
Measure = Callable[[Mapping, Mapping], Any]
Formula = Callable[[Mapping], Any]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a learner's number may be from the measured one: exact (counts), or a relative share."""

    relative: float = 0.0  # 0.01: within 1 % of the measured value

    def accepts(self, guess: float, measured: float) -> bool:
        if self.relative == 0.0:
            return guess == measured
        return math.isclose(guess, measured, rel_tol=self.relative, abs_tol=0.0)

    def __str__(self) -> str:
        return "exact" if self.relative == 0.0 else f"within {self.relative:.0%}"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One question of a lesson.

    `needs`: the `cl.results` key the run cell publishes (before it exists, the reveal says to run
    that cell). `measure(results, ledgers)` and `formula(results)` return the answer, a number or a
    tuple of numbers; they must be equal. `unit` labels numbers ("B", "all-reduces", ""). `explanation`
    says why, from what the lesson taught; it is shown only after the learner's number. It may be a function of
    `results` when the why needs the run's own numbers (counts the run published).
    """

    id: str
    question: str  # the question in a few words, shown with the answer
    needs: str
    measure: Measure
    formula: Formula
    explanation: str | Callable[[Mapping], str]
    unit: str = ""
    tolerance: Tolerance = Tolerance()
