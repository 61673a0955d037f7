"""`%reveal <id> [variable]`: the one line of a prediction's reveal cell (see course_lib/predictions)."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class

from ..errors import OneLineError
from ..predictions import UnknownPrediction, prediction
from ..predictions.reveal import reveal, run_record

__all__ = ["RevealMagics"]


class RevealUsageError(OneLineError):
    """`%reveal` called without an id, or with one no lesson defines."""


@magics_class
class RevealMagics(Magics):
    @line_magic("reveal")
    def reveal_line(self, line: str) -> None:
        """%reveal <prediction id> [variable]: measure, check against the lesson's formula, compare with
        your prediction (the variable, `my_prediction` by default); with no prediction yet, says so."""
        words = line.split()
        if not 1 <= len(words) <= 2:
            raise RevealUsageError("usage: %reveal <prediction id> [variable holding your prediction]")
        variable = words[1] if len(words) == 2 else "my_prediction"
        guess = self.shell.user_ns.get(variable)
        try:
            spec = prediction(words[0])
        except UnknownPrediction as exc:
            raise RevealUsageError(str(exc)) from None
        # The run that published what this prediction needs, not whatever multi-rank cell ran last.
        results, ledgers = run_record(spec.needs)
        print(reveal(spec.id, guess, results, ledgers, variable=variable))
