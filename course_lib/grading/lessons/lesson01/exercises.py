"""Lesson 01's exercises: a ring all-reduce, all-gather from broadcast, a grid of subgroups.

One module per exercise (spec, references and judges: the checker's side) beside `common.py` (the
integer-valued inputs they share); `drivers.py` holds what runs on the ranks. Every reference is computed
in the checker's process without torch.distributed. Judges name the rank, the case and the first wrong
value, and recognise the usual mistakes (averaging, aliasing, swapping rows and columns, passing the
whole tensor around the ring).
"""

from __future__ import annotations

from .allgather_from_broadcast import ALLGATHER
from .grid_groups import GRID
from .ring_allreduce import RING

__all__ = ["EXERCISES"]

EXERCISES = {exercise.id: exercise for exercise in (RING, ALLGATHER, GRID)}
