"""Lesson 02's exercises: gradient buckets, no_sync accumulation, a compression hook, DDP from scratch.

One module per exercise (specs, references and judges: the checker's side); `drivers.py` holds what
runs on the ranks. Every exercise uses a small Linear-ReLU-Linear model (three layers for
02.ddp_from_scratch) with weights drawn in the checker's process from a fixed seed, and each rank
gets its own shard of a batch. The reference is one process on the whole batch, computed without
torch.distributed: averaged gradients and SGD steps within float32 rounding (float16 rounding for
the compression hook). Judges name the rank, the case and the first wrong value, and recognise the
usual mistakes (a sum not divided, an average taken twice, a gradient left as this rank's own, one
all-reduce per tensor, a bucket never copied back, a synchronisation on every micro-batch or on
none, float32 on the wire, a wait inside backward, ranks that start different).
"""

from __future__ import annotations

from .accumulation import ACCUMULATION
from .bucketed import BUCKETED, greedy_buckets
from .common import (ALL_REDUCE, ATOL, DDP_PRELOAD, FP16_ATOL, FP16_RTOL, LR, NAMES, RTOL, _batch, _grads, _model,
                     _sgd_step, _weights)
from .ddp_from_scratch import DDP_FROM_SCRATCH
from .fp16_hook import FP16_HOOK

# Lesson 03's exercises build on this lesson's model and reference (they import these names from here).
__all__ = ["ALL_REDUCE", "ATOL", "DDP_PRELOAD", "EXERCISES", "FP16_ATOL", "FP16_RTOL", "LR", "NAMES", "RTOL", "_batch",
           "_grads", "_model", "_sgd_step", "_weights", "greedy_buckets"]

EXERCISES = {exercise.id: exercise for exercise in (BUCKETED, ACCUMULATION, FP16_HOOK, DDP_FROM_SCRATCH)}
