"""Values that ranks sent back with `cl.publish(name, value)`.

After a cell, `cl.results[name]` is `{rank: value}`, sorted by rank. A later
cell that publishes the same name replaces it.

Each name also keeps the ledgers of the run that published it (`ledgers_of(name)`): a reveal
measures from its own run cell's record, whatever multi-rank cell ran after it (`cl.ledgers` is
only the last cell's: Run All, then going back to a prediction, would otherwise read another run).

After a multi-rank cell that was interrupted, reading `cl.results` or `cl.ledgers` raises one line saying so: the ledgers hold
the cut-off run and the results may be an earlier run's, so a later cell would
otherwise fail with a raw IndexError or show stale numbers. The next cell whose
ranks finish makes them readable again.
"""

from __future__ import annotations

from typing import Any

from .errors import OneLineError

__all__ = ["StaleResults", "ledgers", "ledgers_of", "mark_stale", "record_run", "results"]


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

    def unchecked(self) -> dict:
        """The values as they stand, stale or not (for readers that checked their own run finished)."""
        return dict(super().items())


results: dict[str, dict[int, Any]] = _RunValues()

# The collective ledger of each rank (course_lib/ledger.py) as of the last cell:
# {rank: [{"seq", "op", "group", "shapes", "dtype", "bytes", "start", "end", "async"}, ...]}.
# One-shot cells replace it; persistent ranks accumulate it until the pool restarts.
ledgers: dict[int, list[dict]] = _RunValues()


# name -> the ledgers of the finished run that published it last ({rank: [entry, ...]}, a copy).
_ledgers_by_name: dict[str, dict[int, list[dict]]] = {}


def record_run(published: dict[str, dict[int, Any]], run_ledgers: dict[int, list[dict]], finished: bool) -> None:
    """After a cell: store what it published, and with each name the ledgers of this run.

    A run cut off (`finished` False) leaves its names without a record, so a reveal asks for that
    cell to be run again instead of measuring a partial ledger.
    """
    snapshot = {rank: list(entries) for rank, entries in run_ledgers.items()}
    for name, by_rank in published.items():
        results[name] = dict(sorted(by_rank.items()))
        if finished:
            _ledgers_by_name[name] = snapshot
        else:
            _ledgers_by_name.pop(name, None)
    ledgers.clear()
    ledgers.update(run_ledgers)


def ledgers_of(name: str) -> dict[int, list[dict]] | None:
    """The ledgers of the last finished run that published `name`, or None if none has."""
    return _ledgers_by_name.get(name)


def mark_stale(why: str | None) -> None:
    """After a cell: `why` it did not finish (reads then raise StaleResults), or None when it did."""
    message = None if why is None else f"cl.results and cl.ledgers: the last multi-rank cell {why}: run it again"
    results.stale = ledgers.stale = message
