"""Lesson 05's exercises, one module each: FSDP2's `fully_shard` bottom up (shard_bottom_up), ZeRO-3 by hand as
a module (zero3_linear), gradient accumulation without reduce-scatters (accumulate), a model built on the
meta device and filled from rank 0 (meta_init_broadcast), HSDP on a 2-D mesh (hsdp_mesh). What they share
(models, references, FSDP2's rows) is in `common`; what runs on the ranks, in `drivers`.
"""

from __future__ import annotations

from .accumulate import ACCUMULATE
from .common import ATOL, FSDP2_OPS, LR, RTOL, TOY_2, TOY_3, all_gather_elements, shard_rows, toy_weights
from .hsdp_mesh import HSDP_MESH
from .meta_init_broadcast import META_INIT
from .shard_bottom_up import SHARD_BOTTOM_UP, group_elements
from .zero3_linear import ZERO3_LINEAR

__all__ = ["ATOL", "EXERCISES", "FSDP2_OPS", "LR", "RTOL", "TOY_2", "TOY_3", "all_gather_elements",
           "group_elements", "shard_rows", "toy_weights"]

EXERCISES = {exercise.id: exercise for exercise in (SHARD_BOTTOM_UP, ZERO3_LINEAR, ACCUMULATE, META_INIT, HSDP_MESH)}
