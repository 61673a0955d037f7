"""Grade several submissions at once (`--jobs N`), each on its own ranks, without losing the file guard.

One at a time, the grader snapshots its files before a submission and puts them
back after it, blaming that submission for any change (guard.py). With N at
once a change cannot be pinned on one submission, so after each finishes the
guard is checked: if something changed, the finished one and every one still
running are suspects; their results are thrown away and they are graded again,
one at a time, at the end. Results are written under a lock, and the snapshot
is retaken after each write, so the grader's own writes are never mistaken for
a learner's.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, TypeVar

from .guard import FileGuard

__all__ = ["grade_one_at_a_time", "grade_in_parallel"]

Item = TypeVar("Item", bound=Hashable)
Graded = TypeVar("Graded")


def grade_one_at_a_time(items: list[Item], grade_one: Callable[[Item], Graded], guard: FileGuard,
                        record: Callable[[Item, Graded, list[str]], None]) -> None:
    """Snapshot, grade, restore, record, for each item in turn: changes are blamed on that item."""
    for item in items:
        guard.snapshot()
        graded = grade_one(item)
        record(item, graded, guard.restore())


def grade_in_parallel(items: list[Item], grade_one: Callable[[Item], Graded], guard: FileGuard,
                      record: Callable[[Item, Graded, list[str]], None], jobs: int) -> None:
    """Grade `jobs` items at a time; suspects of a change to the guarded files are graded again alone."""
    lock = threading.Lock()
    running: set[Item] = set()
    suspects: set[Item] = set()
    guard.snapshot()

    def one(item: Item) -> None:
        with lock:
            running.add(item)
        graded = grade_one(item)
        with lock:
            running.discard(item)
            if guard.restore():
                suspects.update(running | {item})
            if item not in suspects:
                record(item, graded, [])
                guard.snapshot()  # the files just written are the grader's

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="grade") as pool:
        list(pool.map(one, items))  # list(): re-raises the first exception of any job
    grade_one_at_a_time([item for item in items if item in suspects], grade_one, guard, record)
