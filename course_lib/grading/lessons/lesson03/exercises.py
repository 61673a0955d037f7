"""Lesson 03's exercises: uneven inputs under Join, a Joinable of one's own, ZeRO's state saved by each
rank and resumed on another number of ranks, and ZeRO-1 written by hand. One module per exercise (specs,
references, judges); the ranks' side is `drivers.py`; what they share is `common.py`."""

from __future__ import annotations

from .common import ADAM_LR, ATOL, LR, RTOL, greedy_owners, optimizer_reference
from .counting_joinable import COUNTING
from .join_training import JOIN_TRAINING, first_out, join_reference
from .zero1_by_hand import ZERO1, ZERO1_DEFAULTS
from .zero_checkpoint import ZERO_SHARDED

__all__ = ["ADAM_LR", "ATOL", "EXERCISES", "LR", "RTOL", "ZERO1_DEFAULTS", "first_out", "greedy_owners",
           "join_reference", "optimizer_reference"]

EXERCISES = {exercise.id: exercise for exercise in (JOIN_TRAINING, COUNTING, ZERO_SHARDED, ZERO1)}
