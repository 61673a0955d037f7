"""Argument checks and errors shared by the notebook magics (%%torchrun, %dist, %%dist).

The options themselves are declared on each magic with IPython's
`magic_arguments`, so `%%torchrun?` and `%dist?` list them. Bad input must
give a one-line `UsageError` that names the magic, never argparse's usage
text and `SystemExit`, nor a traceback through this library.
"""

from __future__ import annotations

import argparse
import math
import shlex

from IPython.core.error import UsageError

from ..errors import OneLineError

__all__ = ["DEFAULT_NPROC", "MAX_NPROC", "MAX_RESTARTS", "CellInterrupted", "RankFailure", "parse_line",
           "positive_seconds", "rank_count", "restart_count"]

DEFAULT_NPROC = 2
MAX_NPROC = 64
MAX_RESTARTS = 10


def _whole_number(text: str, what: str, low: int, high: int) -> int:
    """`text` as an int in [low, high], else argparse's error in one line ("... of ranks ...")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of {what}, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"number of {what} must be between {low} and {high}, got {value}")
    return value


def rank_count(text: str) -> int:
    return _whole_number(text, "ranks", 1, MAX_NPROC)


def restart_count(text: str) -> int:
    return _whole_number(text, "restarts", 0, MAX_RESTARTS)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):  # "nan" would mean no deadline at all
        raise argparse.ArgumentTypeError(f"timeout must be a positive number of seconds, got {text}")
    return value


def parse_line(magic, line: str, name: str) -> argparse.Namespace:
    """Parse the magic's line with the parser `@magic_arguments` built for `magic`.

    Bad input raises a one-line UsageError that starts with `name` (e.g.
    "%%torchrun: "): IPython's parser raises one without it.
    """
    # NOTE: split like a shell (quotes removed), not with IPython's own
    # `parse_argstring`, whose non-POSIX split keeps the quotes: --ranks "0,2".
    try:
        # comments=True: a `# ...` after the options is a comment, as on any line of Python.
        return magic.parser.parse_args(shlex.split(line, comments=True))
    except (UsageError, ValueError) as exc:  # ValueError: shlex, e.g. "No closing quotation"
        raise UsageError(f"{name}: {exc}") from None


class RankFailure(OneLineError):
    """A multi-rank cell whose ranks failed or ran past the deadline (the rank's own traceback is shown above)."""


class CellInterrupted(KeyboardInterrupt):
    """Ctrl-C (or the stop button) during a multi-rank cell, raised after the cell printed what it stopped.

    Still a KeyboardInterrupt, so the cell ends in error and "Run All" stops
    there; IPython shows `_render_traceback_()`, the one line Python ends an
    interrupt with, instead of a traceback through run_cell_magic and this library.
    """

    def _render_traceback_(self) -> list[str]:
        return ["KeyboardInterrupt"]
