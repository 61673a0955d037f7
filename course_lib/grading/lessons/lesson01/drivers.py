"""The rank side of lesson 01: collectives from point-to-point messages, process groups: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...drivers import describe

__all__ = ['in_place', 'returns_tensor_list', 'process_groups']


def in_place(fn: Callable, tensor: torch.Tensor) -> dict:
    """fn(t) changes t in place: send back t afterwards (and what fn returned, by type)."""
    t = tensor.clone()
    returned = fn(t)
    return {"tensor": t, "returned": describe(returned)}


def returns_tensor_list(fn: Callable, tensor: torch.Tensor) -> dict:
    """fn(t) returns a list of tensors: send back the list (copied) and t afterwards."""
    t = tensor.clone()
    returned = fn(t)
    if not isinstance(returned, (list, tuple)) or not all(isinstance(x, torch.Tensor) for x in returned):
        return {"not_a_tensor_list": describe(returned), "input_after": t}
    # Entries that are the same object would be saved once and come back equal:
    # keep which entries share storage, then copy each.
    shared = [[j for j, y in enumerate(returned) if j != i and y.data_ptr() == x.data_ptr() and x.numel()]
              for i, x in enumerate(returned)]
    return {"list": [x.detach().clone() for x in returned], "shared": shared, "input_after": t}


def process_groups(fn: Callable, rows: int, cols: int) -> dict:
    """fn(rows, cols) returns (row_group, col_group): send back their members and a sum over each."""
    import torch.distributed as dist

    returned = fn(rows, cols)
    if not isinstance(returned, (list, tuple)) or len(returned) != 2:
        return {"not_a_pair": describe(returned)}
    described = {}
    for name, group in zip(("row", "col"), returned):
        try:
            members = dist.get_process_group_ranks(group)
        except Exception as exc:  # noqa: BLE001 - not a group, or one this rank is not in
            described[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
            continue
        # The group must also work: the sum of its members' ranks, computed over it.
        total = torch.tensor([dist.get_rank()], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        described[name] = {"members": list(members), "sum": int(total.item())}
    return described
