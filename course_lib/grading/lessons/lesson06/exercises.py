"""Lesson 06's exercises, one module each, each building by hand what the lesson left to torch: sequence
parallelism's operators around Megatron's MLP (sp_mlp), a vocabulary-parallel embedding (vocab_embedding),
the cross-entropy of vocabulary-sharded logits (vocab_cross_entropy). What they share is in `common`; what
runs on the ranks, in `drivers`.
"""

from __future__ import annotations

from .common import ATOL, RTOL
from .sp_mlp import SP_MLP
from .vocab_cross_entropy import VOCAB_CROSS_ENTROPY
from .vocab_embedding import VOCAB_EMBEDDING

__all__ = ["ATOL", "EXERCISES", "RTOL"]

EXERCISES = {exercise.id: exercise for exercise in (SP_MLP, VOCAB_EMBEDDING, VOCAB_CROSS_ENTROPY)}
