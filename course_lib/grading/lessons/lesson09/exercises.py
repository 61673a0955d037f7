"""Lesson 09's exercises, one module each: ring attention's forward with the online softmax's running state
(ring_online), its backward with dk and dv carried around the ring (ring_backward), the zigzag split and its
inverse for any length (zigzag). What they share is in `common` and `ring_common`; what runs on the ranks, in
`drivers`.
"""

from __future__ import annotations

from .ring_backward import RING_BACKWARD
from .ring_online import RING_ONLINE
from .zigzag import ZIGZAG

__all__ = ["EXERCISES"]

EXERCISES = {exercise.id: exercise for exercise in (RING_ONLINE, RING_BACKWARD, ZIGZAG)}
