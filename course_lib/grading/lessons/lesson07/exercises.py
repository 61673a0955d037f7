"""Lesson 07's exercises, one module each: a `Stateful` app state whose resume reproduces the uninterrupted run
(app_state), a checkpoint loaded into another layout (reshard_load), a save that a rank lost in the middle cannot
turn into the checkpoint a restart loads (crash_safe_save). What they share is in `common`; what runs on the
ranks, in `drivers`.
"""

from __future__ import annotations

from .app_state import APP_STATE
from .common import ATOL, RTOL, one_process
from .crash_safe_save import CRASH_SAFE
from .reshard_load import RESHARD_LOAD

__all__ = ["ATOL", "EXERCISES", "RTOL", "one_process"]

EXERCISES = {exercise.id: exercise for exercise in (APP_STATE, RESHARD_LOAD, CRASH_SAFE)}
