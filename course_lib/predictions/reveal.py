"""The reveal cell's work (`%reveal <id>`): measure, assert against the formula, compare with the learner's number."""

from __future__ import annotations

import json
import os
import pathlib
import textwrap
from typing import Any, Mapping

from ..errors import OneLineError
from . import prediction as find_prediction
from .spec import Prediction

__all__ = ["ANSWERS_ENV", "RevealError", "forget_first_answers", "record_answer", "reveal", "run_record", "write_first"]

# Set by `make notebooks`: each reveal then writes the answer it measured to <folder>/lessonNN.json, which
# tests/test_think_first.py reads to check that no stored output shows the answer before the reveal.
ANSWERS_ENV = "COURSE_REVEAL_ANSWERS"

WRITE_FIRST = ("Write your prediction first: set {variable} in the cell above to your answer, "
               "then run this cell again.")


class RevealError(OneLineError):
    """A reveal that cannot be made (its run cell has not run, or torch no longer agrees with the lesson)."""


def write_first(variable: str) -> str:
    """What a reveal prints while the prediction is empty: no number, so a stored output gives nothing away."""
    return WRITE_FIRST.format(variable=variable)


# prediction id -> the learner's first answer in this kernel: the one scored, shown beside any later one
# (after a reveal shows the measured answer, a second try would otherwise always read "right").
_first_answers: dict[str, tuple] = {}

WIDTH = 100  # reveal lines wrap here (JupyterLab's output area shows about this many columns)


def forget_first_answers() -> None:
    """Forget every first answer (tests; a kernel restart does the same)."""
    _first_answers.clear()


def run_record(needs: str) -> tuple[Mapping, Mapping]:
    """(results, ledgers) of the finished run that published `needs`: a reveal measures its own run cell,
    whatever multi-rank cell ran after it. RevealError (one line) when no finished run has published it
    (not run yet, interrupted, or the kernel restarted)."""
    from ..results import ledgers_of, results

    run_ledgers = ledgers_of(needs)
    if run_ledgers is None:
        raise RevealError(_not_run(needs))
    return results.unchecked(), run_ledgers


def _not_run(needs: str) -> str:
    return (f"nothing measured yet: run the cell above that publishes {needs!r} (its cl.publish({needs!r}, ...)) "
            "to the end, then this one")


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _shown(value: Any, unit: str) -> str:
    parts = [f"{v:,}" if isinstance(v, int) else f"{v:,.6g}" if isinstance(v, float) else str(v)
             for v in _as_tuple(value)]
    text = ", ".join(parts) if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    return f"{text} {unit}".rstrip()


def measured_answer(spec: Prediction, results: Mapping, ledgers: Mapping) -> Any:
    """The measured answer, asserted equal to the lesson's formula (RevealError if the run is missing or they differ:
    no number in that line, since it comes before the learner's prediction)."""
    if spec.needs not in results:
        raise RevealError(_not_run(spec.needs))
    measured = spec.measure(results, ledgers)
    expected = spec.formula(results)
    if _as_tuple(measured) != _as_tuple(expected):
        raise RevealError(f"{spec.id}: the run's measurement differs from the lesson's formula: if you changed the "
                          "run cell, run the lesson's own again; if not, the lesson no longer describes this torch "
                          "(please report it)")
    return measured


def record_answer(prediction_id: str, measured: Any) -> None:
    """Write `measured` to $COURSE_REVEAL_ANSWERS/lessonNN.json under the prediction's id (nothing when unset)."""
    folder = os.environ.get(ANSWERS_ENV)
    if not folder:
        return
    path = pathlib.Path(folder) / f"lesson{prediction_id.split('.')[0]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    known = json.loads(path.read_text()) if path.exists() else {}
    known[prediction_id] = list(_as_tuple(measured))
    path.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


def reveal(prediction_id: str, guess: Any, results: Mapping, ledgers: Mapping, variable: str = "my_prediction") -> str:
    """The text a reveal cell prints for `guess` (None: only the line asking for a prediction)."""
    spec = find_prediction(prediction_id)
    measured = measured_answer(spec, results, ledgers)
    record_answer(prediction_id, measured)
    if guess is None:
        return write_first(variable)
    guesses, answers = _as_tuple(guess), _as_tuple(measured)
    if len(guesses) != len(answers) or not all(isinstance(g, (int, float)) for g in guesses):
        raise RevealError(f"{variable} should be {len(answers)} number{'s' if len(answers) > 1 else ''} "
                          f"({spec.question}), got {guess!r}")
    verdict = _verdict(spec, guesses, answers)
    lines = [f"{spec.question}: you predicted {_shown(guess, spec.unit)}; measured {_shown(measured, spec.unit)} "
             f"({spec.tolerance}): {verdict}."]
    first = _first_answers.setdefault(prediction_id, guesses)
    if first != guesses:
        lines.append(f"Your first prediction, {_shown(first, spec.unit)}, is the one that counts: "
                     f"{_verdict(spec, first, answers)}.")
    lines.append("Why: " + (spec.explanation(results) if callable(spec.explanation) else spec.explanation))
    return "\n".join(wrapped for line in lines for wrapped in textwrap.wrap(line, width=WIDTH, subsequent_indent="  ",
                                                                          break_on_hyphens=False))


def _verdict(spec: Prediction, guesses: tuple, answers: tuple) -> str:
    right = all(spec.tolerance.accepts(g, a) for g, a in zip(guesses, answers))
    return "right" if right else "not this time"
