"""Argument parsing and errors shared by the notebook magics (%%torchrun, %dist, %%dist).

Bad input must give a one-line `UsageError`, never argparse's usage text and
`SystemExit`, nor a traceback through this library.
"""

from __future__ import annotations

import argparse
import math
import shlex

from IPython.core.error import UsageError

from ..errors import OneLineError

__all__ = ["MAX_NPROC", "MagicParser", "RankFailure", "parse_line", "positive_seconds", "rank_count"]

MAX_NPROC = 64


class MagicParser(argparse.ArgumentParser):
    """argparse that raises a one-line UsageError (named after the magic) instead of exiting."""

    def error(self, message: str):  # argparse would print usage and sys.exit
        raise UsageError(f"{self.prog}: {message}")


def rank_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks, got {text!r}") from None
    if not 1 <= value <= MAX_NPROC:
        raise argparse.ArgumentTypeError(f"number of ranks must be between 1 and {MAX_NPROC}, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):  # "nan" would mean no deadline at all
        raise argparse.ArgumentTypeError(f"timeout must be a positive number of seconds, got {text}")
    return value


def parse_line(parser: MagicParser, line: str) -> argparse.Namespace:
    """Split the magic's line like a shell and parse it; bad input raises a one-line UsageError."""
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None
    return parser.parse_args(words)


class RankFailure(OneLineError):
    """A multi-rank cell whose ranks failed or ran past the deadline (the rank's own traceback is shown above)."""
