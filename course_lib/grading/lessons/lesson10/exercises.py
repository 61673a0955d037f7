"""Lesson 10's exercises, one module each: capacity in batch prioritized order (priority_capacity), expert
parallelism with each token sent once per rank (dedup_dispatch), Switch's balance loss over all data-parallel
ranks (global_balance). What they share is in `common`; what runs on the ranks, in `drivers`.
"""

from __future__ import annotations

from .dedup_dispatch import DEDUP_DISPATCH
from .global_balance import GLOBAL_BALANCE
from .priority_capacity import PRIORITY_CAPACITY

__all__ = ["EXERCISES"]

EXERCISES = {exercise.id: exercise for exercise in (PRIORITY_CAPACITY, DEDUP_DISPATCH, GLOBAL_BALANCE)}
