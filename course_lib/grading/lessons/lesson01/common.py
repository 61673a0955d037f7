"""What lesson 01's exercises share: integer-valued inputs made in the checker's process, and case labels.

Inputs are integer-valued tensors made from a fixed seed here, so sums are exact in any order and every
reference is computed without torch.distributed.
"""

from __future__ import annotations

from ....vocabulary import RECEIVES, SENDS
from ...spec import RunOutcome

__all__ = ["P2P_OPS", "_case_label", "_int64", "_integer_tensors"]

P2P_OPS = frozenset(SENDS + RECEIVES)


def _integer_tensors(nproc: int, shapes: list[tuple], seed: int, dtype=None) -> list[dict[int, tuple]]:
    """One case per shape; rank r gets its own integer-valued tensor (floats unless dtype is given)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    cases = []
    for shape in shapes:
        case = {}
        for rank in range(nproc):
            values = torch.randint(-9, 10, shape, generator=generator)
            case[rank] = (values.to(dtype or torch.float32),)
        cases.append(case)
    return cases


def _case_label(outcome: RunOutcome, case: int) -> str:
    shape = list(outcome.inputs[case][0][0].shape)
    return f"case {case + 1} of {len(outcome.inputs)} (shape {shape})"


def _int64():
    import torch

    return torch.int64
