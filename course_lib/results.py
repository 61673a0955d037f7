"""Values that ranks sent back with `cl.publish(name, value)`.

After a cell, `cl.results[name]` is `{rank: value}`, sorted by rank. A later
cell that publishes the same name replaces it.

After a multi-rank cell that was interrupted, reading `cl.results` or `cl.ledgers` raises one line saying so: the ledgers hold
the cut-off run and the results may be an earlier run's, so a later cell would
otherwise fail with a raw IndexError or show stale numbers. The next cell whose
ranks finish makes them readable again.
"""

from __future__ import annotations

from typing import Any

from .errors import OneLineError

__all__ = ["StaleResults", "ledgers", "mark_stale", "results"]


class StaleResults(OneLineError, KeyError):
    """The last multi-rank cell did not finish: what it would have published is missing or partial."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class _RunValues(dict):
    """A dict that refuses reads in one line while the run behind it was cut off (`stale`)."""

    stale: str | None = None

    def _check(self) -> None:
        if self.stale is not None:
            raise StaleResults(self.stale)

    def __getitem__(self, key):
        self._check()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._check()
        return super().get(key, default)

    def items(self):
        self._check()
        return super().items()

    def values(self):
        self._check()
        return super().values()


results: dict[str, dict[int, Any]] = _RunValues()

# The collective ledger of each rank (course_lib/ledger.py) as of the last cell:
# {rank: [{"seq", "op", "group", "shapes", "dtype", "bytes", "start", "end", "async"}, ...]}.
# One-shot cells replace it; persistent ranks accumulate it until the pool restarts.
ledgers: dict[int, list[dict]] = _RunValues()


def mark_stale(why: str | None) -> None:
    """After a cell: `why` it did not finish (reads then raise StaleResults), or None when it did."""
    message = None if why is None else f"cl.results and cl.ledgers: the last multi-rank cell {why}: run it again"
    results.stale = ledgers.stale = message
