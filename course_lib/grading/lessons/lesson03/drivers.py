"""The rank side of lesson 03: uneven inputs, Join, ZeRO: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data). The grading ranks form a gloo group on the
CPU (rank_runner.py), even on a GPU node: the CPU is every rank's device here, so the models, batches and
the checker's own tensors (its barriers' `torch.zeros(1)`) live there.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ...drivers import describe, refused
from ..lesson02.drivers import _copies, mlp_from_weights, shared_parameters_named

__all__ = ['ddp_join_training', 'counting_joinable', 'zero_sharded_checkpoint', 'zero1_by_hand']


class _JoinAwareAveraging:
    """State of `_join_aware_allreduce`: the DDP model and the work of its latest forward's join notice."""

    def __init__(self, ddp_model):
        self.ddp_model = ddp_model
        self.forward_work = None  # Join.notify_join_context's all_reduce of ones: how many ranks still train


def _join_aware_allreduce(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP's own averaging of a gradient bucket, issued from Python so that the ledger records it.

    The sum over the ranks (`dist.all_reduce`, blocking: a rank that waits in it is named at a
    deadline), divided as DDP's C++ Reducer divides: by the initial world size, or, after
    `Join([ddp], divide_by_initial_world_size=False)`, by the ranks that have not joined (the result
    of the forward's join notice). torch's stock `allreduce_hook` always divides by the world size,
    so it would hide that option. A joined rank calls this too (DDP's join hook), with zeros.
    """
    import torch.distributed as dist

    buffer = bucket.buffer()
    divisor = dist.get_world_size()
    work = state.forward_work
    if work is not None and not getattr(state.ddp_model, "_divide_by_initial_world_size", True):
        work.wait()
        divisor = int(work.result()[0].item())
    buffer.div_(divisor)
    dist.all_reduce(buffer)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _as_rank(value):
    """What `train` returned, as an int where it is one (1, 1.0, tensor([1])); else None or in words."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if value is None or type(value) is int else describe(value)


def ddp_join_training(fn: Callable, weights: list, batches: list, lr: float, stop_at_first: bool) -> dict:
    """fn(ddp_model, SGD(lr), batches, stop_at_first) trains on this rank's batches (their number differs per
    rank) and returns the rank that ran out first.

    DDP averages through `_join_aware_allreduce`; while fn runs, DDP's module sees a Join whose join
    notice also tells that hook how many ranks still train. Send back the parameters afterwards.
    """
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_module
    from torch.nn.parallel import DistributedDataParallel

    model = mlp_from_weights(weights)
    ddp_model = DistributedDataParallel(model)
    state = _JoinAwareAveraging(ddp_model)
    ddp_model.register_comm_hook(state, _join_aware_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    join = ddp_module.Join  # DDP's forward calls Join.notify_join_context(self) through this name

    class NoticeKeepingJoin(join):
        @staticmethod
        def notify_join_context(joinable):
            work = join.notify_join_context(joinable)
            if joinable is ddp_model:
                state.forward_work = work
            return work

    ddp_module.Join = NoticeKeepingJoin
    try:
        returned = fn(ddp_model, optimizer, [tuple(pair) for pair in batches], bool(stop_at_first))
    finally:
        ddp_module.Join = join
    return {"params": _copies(dict(model.named_parameters())), "returned": _as_rank(returned)}


def _as_number(value):
    """A counter's attribute as a float (a number or a one-element tensor), else in words."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return describe(value)


def counting_joinable(fn: Callable, values: list) -> dict:
    """`fn` is the learner's Joinable class: counter = fn(); with Join([counter]) (torch's, imported
    here), call counter(v) for each v of `values` (their number differs per rank). Send back count,
    total, peak and is_last_joiner afterwards. The whole block counts as the learner's code for a deadline."""
    from torch.distributed.algorithms.join import Join, Joinable

    cls = inspect.unwrap(fn)
    with fn.learner_code():
        counter = cls()
        if not isinstance(counter, Joinable):
            return {"not_joinable": describe(counter)}
        with Join([counter]):
            for value in values:
                counter(float(value))
    last = getattr(counter, "is_last_joiner", None)
    return {**{key: _as_number(getattr(counter, key, None)) for key in ("count", "total", "peak")},
            "is_last_joiner": last if isinstance(last, bool) or last is None else describe(last)}


def _state_mismatch(optimizer, model) -> str:
    """The first state tensor of the inner optimizer whose shape is not its parameter's, in words; else ""."""
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.optim.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state.get(key) if isinstance(state, dict) else None
            if isinstance(value, torch.Tensor) and value.shape != p.shape:
                return (f"the state of {names.get(id(p), 'a parameter')} holds {key} of shape {list(value.shape)}, "
                        f"its parameter has shape {list(p.shape)}")
    return ""


def zero_sharded_checkpoint(fn: Callable, weights: list, before: list, after: list, world_save: int,
                            world_load: int, lr: float, folder_name: str) -> dict:
    """On ranks 0..world_save-1 (their own group, or the world): DDP and ZeroRedundancyOptimizer(Adam, lr) take
    one step per (inputs, targets) of `before` (this rank's rows), then fn(optimizer, folder) saves (`folder`:
    `folder_name` in the run's working folder, the same on every rank, empty). The checker waits for every
    rank (an all-reduce of one value), then on ranks 0..world_load-1 builds a new DDP (its constructor
    broadcasts rank 0's trained parameters) and ZeroRedundancyOptimizer, calls the cell's
    load_shards(new, folder) and takes one step per pair of `after`. Send back when fn ran (its ledger
    span), the parameters at the end, load_shards' error and a state tensor of the wrong shape, if any."""
    import os
    import time

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank creates every group, in the same order (new_group's rule); the whole world is the default group.
    groups = {n: None if n == world else dist.new_group(list(range(n))) for n in sorted({world_save, world_load})}
    model = mlp_from_weights(weights)
    folder = os.path.join(os.getcwd(), folder_name)
    os.makedirs(folder, exist_ok=True)

    def build(n):
        group = groups[n]
        ddp_model = DistributedDataParallel(model, process_group=group)
        ddp_model.register_comm_hook(group or dist.group.WORLD, allreduce_hook)  # the ledger records them
        return ddp_model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                                  process_group=group, lr=lr)

    def train(ddp_model, optimizer, pairs):
        for inputs, targets in pairs:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(inputs), targets).backward()
            optimizer.step()

    save_span, returned = None, None
    if rank < world_save:
        ddp_model, optimizer = build(world_save)
        train(ddp_model, optimizer, before)
        started = time.monotonic()
        returned = fn(optimizer, folder)
        save_span = (started, time.monotonic())
        del ddp_model, optimizer  # DDP's reducer goes with it: the next DDP over the model is the only one
    dist.all_reduce(torch.zeros(1))  # the checker's barrier: every file is written before any rank loads
    result = {"save_span": save_span, "returned": describe(returned), "load_error": "", "shape_problem": ""}
    if rank < world_load:
        ddp_model, resumed = build(world_load)
        load = inspect.unwrap(fn).__globals__.get("load_shards")
        if not callable(load):
            result["load_error"] = "nothing: the cell defines no function load_shards(optimizer, folder)"
        else:
            with fn.learner_code():
                try:
                    load(resumed, folder)
                except Exception as exc:  # noqa: BLE001 - reported by the judges of resuming; saving is judged apart
                    result["load_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not result["load_error"]:
            result["shape_problem"] = _state_mismatch(resumed, model)
        # Train only if every resuming rank can: one rank training alone would wait for the others forever.
        failed = torch.tensor([float(bool(result["load_error"] or result["shape_problem"]))])
        dist.all_reduce(failed, group=groups[world_load])
        if not failed.item():
            train(ddp_model, resumed, after)
    return {**result, "params": _copies(dict(model.named_parameters()))}


def zero1_by_hand(fn: Callable, weights: list, steps: list, optimizer_name: str, defaults: dict, frozen=(),
                  tied=()) -> dict:
    """`fn` is the learner's ShardedOptimizer class: optimizer = fn(model.parameters(), torch.optim.<name>,
    **defaults) over a plain model (`frozen`, `tied`: see mlp_from_weights); one step per (inputs, targets) of
    `steps` (this rank's rows), each
    zero_grad(), backward of mse_loss, step(). Send back the parameters, the bytes of the tensors in
    optimizer.optim.state, and which parameters (by index) optimizer.optim holds."""
    model = mlp_from_weights(weights, frozen, [tuple(pair) for pair in tied])
    cls = inspect.unwrap(fn)
    with fn.learner_code(), shared_parameters_named(frozen, tied), refused(("torch.distributed.optim", "ZeroRedundancyOptimizer", "ZeroRedundancyOptimizer")):
        optimizer = cls(model.parameters(), getattr(torch.optim, optimizer_name), **defaults)
        for inputs, targets in steps:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.clone()), targets.clone()).backward()
            optimizer.step()
    result = {"params": _copies(dict(model.named_parameters())), "state_bytes": None, "owned": None, "problem": ""}
    inner = getattr(optimizer, "optim", None)
    if not isinstance(inner, torch.optim.Optimizer):
        result["problem"] = (f"optimizer.optim is a {describe(inner)}, expected the inner torch.optim optimizer "
                             "(over this rank's own parameters)")
        return result
    index = {id(p): i for i, p in enumerate(model.parameters())}
    result["owned"] = sorted(index[id(p)] for group in inner.param_groups for p in group["params"] if id(p) in index)
    result["state_bytes"] = int(sum(t.numel() * t.element_size() for state in inner.state.values()
                                    for t in state.values() if isinstance(t, torch.Tensor)))
    return result
