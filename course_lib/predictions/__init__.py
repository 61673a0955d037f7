"""Predictions: the learner writes a number, then a reveal cell measures, checks and explains.

A lesson asks a question in markdown, the learner writes a number (or a small
tuple) in a cell `my_prediction = None`, a run cell publishes what the ranks
did (`cl.publish`, and the ledger), and a reveal cell tagged `reveal` holds one
line, `%reveal <id>`. The reveal

1. measures the answer from `cl.results` / `cl.ledgers` (the prediction's `measure`),
2. asserts it equals the lesson's formula (`formula`, from `cl.theory` and the
   shapes the run published), so a drift between the lesson's text and torch fails
   under nbval,
3. prints the measured value, the learner's value and the explanation only when
   `my_prediction` is filled in; otherwise one line saying to write it first, so the
   stored output of a reveal cell holds no number.

The formula and the explanation live here, one module per lesson
(`lessonNN.py`, `PREDICTIONS = {...}`), never in the reveal cell's source.
"""

from __future__ import annotations

import functools
import importlib
import types

from .spec import Prediction, Tolerance

__all__ = ["LESSONS", "Prediction", "Tolerance", "UnknownPrediction", "all_predictions", "prediction"]

LESSONS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10")  # each has predictions/lessonNN.py


class UnknownPrediction(KeyError):
    def __str__(self) -> str:
        return self.args[0]


@functools.cache
def all_predictions() -> types.MappingProxyType:
    """{id: Prediction} of every lesson, built once per process."""
    found: dict[str, Prediction] = {}
    for lesson in LESSONS:
        module = importlib.import_module(f"{__name__}.lesson{lesson}")
        for key, spec in module.PREDICTIONS.items():
            assert key == spec.id and key.startswith(f"{lesson}."), key
            found[key] = spec
    return types.MappingProxyType(found)


def prediction(prediction_id: str) -> Prediction:
    known = all_predictions()
    if prediction_id not in known:
        raise UnknownPrediction(f"no prediction {prediction_id!r}; known: {', '.join(sorted(known))}")
    return known[prediction_id]
