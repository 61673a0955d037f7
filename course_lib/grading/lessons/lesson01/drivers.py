"""The rank side of lesson 01: collectives from point-to-point messages, process groups: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...drivers import describe

__all__ = ['in_place', 'returns_tensor_list', 'process_groups']

LAZY_INIT = "TORCH_GLOO_LAZY_INIT"  # read by each new gloo group: connect at the first collective, not at creation


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
    """fn(rows, cols) returns (row_group, col_group): send back their members and a sum over each.

    gloo connects a new group's ranks when it is created, through the store, under the group's name;
    a plain `new_group` names groups by a per-process counter. Ranks that each create only their own
    groups give different groups the same name, and gloo then pairs ranks of both: a hang or a wrong
    sum, which one depending on timing. So while `fn` runs, gloo groups are created lazily
    (TORCH_GLOO_LAZY_INIT: connected at their first collective), and before any collective over them
    every rank compares the names and members of all ranks' groups over the world group: a name
    that stands for two member sets is reported, every time, and its group is not used.
    """
    import os

    import torch.distributed as dist

    before = os.environ.get(LAZY_INIT)
    os.environ[LAZY_INIT] = "1"
    try:
        returned = fn(rows, cols)
    finally:
        if before is None:
            os.environ.pop(LAZY_INIT, None)
        else:
            os.environ[LAZY_INIT] = before
    if not isinstance(returned, (list, tuple)) or len(returned) != 2:
        return {"not_a_pair": describe(returned)}
    described, named = {}, {}
    for name, group in zip(("row", "col"), returned):
        try:
            members = dist.get_process_group_ranks(group)
        except Exception as exc:  # noqa: BLE001 - not a group, or one this rank is not in
            described[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
            continue
        described[name] = {"members": list(members)}
        named[name] = ((group if group is not None else dist.group.WORLD).group_name, sorted(members))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, named)  # the world group: connected long before fn ran
    members_of_name: dict = {}
    for rank, groups in enumerate(everyone):
        for group_name, members in groups.values():
            members_of_name.setdefault(group_name, {}).setdefault(tuple(members), rank)
    for name, group in zip(("row", "col"), returned):
        if name not in named:
            continue
        group_name, members = named[name]
        others = {m: r for m, r in members_of_name[group_name].items() if list(m) != members}
        if others:
            other_members, rank = next(iter(others.items()))
            described[name]["same_name"] = {"name": group_name, "members": list(other_members), "rank": rank}
            continue  # gloo would pair ranks of both groups
        # The group must also work: the sum of its members' ranks, computed over it.
        total = torch.tensor([dist.get_rank()], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        described[name]["sum"] = int(total.item())
    return described
