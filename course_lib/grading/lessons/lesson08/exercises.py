"""Lesson 08's exercises, one module each: a GPipe step by hand for any number of ranks (gpipe), the 1F1B order
of any rank (one_f_one_b), stages balanced by layer cost (balance). What they share is in `common`; what runs on
the ranks, in `drivers`.
"""

from __future__ import annotations

from .balance import BALANCE
from .gpipe import GPIPE
from .one_f_one_b import ONE_F_ONE_B

__all__ = ["EXERCISES"]

EXERCISES = {exercise.id: exercise for exercise in (GPIPE, ONE_F_ONE_B, BALANCE)}
