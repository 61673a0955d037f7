"""Lesson 04's exercises: FSDP1's auto-wrap policy, a FlatParameter's shard, gradient clipping, a full
checkpoint, and the memory a rank holds per sharding strategy. One module per exercise (its specs,
references and judges: the checker's side); `drivers` is the ranks' side, `common` what they share.

Every run wraps a small model in `FullyShardedDataParallel` (gloo, `device_id=torch.device("cpu")`) on
real ranks, with weights drawn here, in the checker's process, from a fixed seed. The references are one
process, computed here without torch.distributed, or what FSDP itself built or held on each rank (the
shard size, the bytes measured). Judges name the rank, the case and the first wrong value, and recognise
the usual mistakes.
"""

from __future__ import annotations

from .clip_grad_norm import CLIP
# Lesson 05's grading imports these from here (its helper may move to .common): kept as they were named.
from .common import ATOL, LR, RTOL, sgd_reference
from .common import draw_batch as _batch
from .common import draw_weights as _weights
from .flat_shard_numel import FLAT_SHARD
from .full_state_dict import FULL_STATE_DICT
from .memory_per_rank import MEMORY
from .wrap_policy import WRAP_POLICY

__all__ = ["ATOL", "EXERCISES", "LR", "RTOL", "sgd_reference"]

EXERCISES = {exercise.id: exercise for exercise in (WRAP_POLICY, FLAT_SHARD, CLIP, FULL_STATE_DICT, MEMORY)}
