"""The rank side of lesson 02: gradients and DDP: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).

Device: the model, the batches and the tensors handed to the learner live on the rank's device
(`rank_device()`: the GPU under NCCL, else the CPU); what comes back is on the CPU, where the
checker's single-process reference is. The grader's ranks run gloo on the CPU (rank_set.GLOO),
also on a GPU node, so there the device is the CPU.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch

from ...drivers import describe, rank_device

__all__ = ['mlp_from_weights', 'shared_parameters_named', 'in_place_list', 'ddp_accumulation', 'ddp_comm_hook', 'ddp_from_scratch']


def _to(pairs: list, device: torch.device) -> list:
    """(inputs, targets) pairs moved to `device`."""
    return [(x.to(device), y.to(device)) for x, y in pairs]


def mlp_from_weights(weights: list[torch.Tensor], frozen=(), tied=()) -> torch.nn.Sequential:
    """Linear -> ReLU -> ... -> Linear holding copies of `weights` = [0.weight, 0.bias, 2.weight, 2.bias, ...], float32.

    One Linear per (weight, bias) pair, a ReLU between two. `tied`: (name, source) pairs, the
    parameter `name` replaced by the Parameter `source` (one tensor used twice, listed once by
    parameters(); its value in `weights` unused); `frozen`: names that get requires_grad=False.
    The checker builds its single-process reference from the same call, so both hold the same values.
    """
    layers: list[torch.nn.Module] = []
    for weight in weights[::2]:
        if layers:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(weight.shape[1], weight.shape[0]))
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), weights):
            parameter.copy_(value)
    for name, source in tied:
        owner, attribute = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attribute, model.get_parameter(source))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name not in frozen)
    return model


@contextlib.contextmanager
def shared_parameters_named(frozen=(), tied=()):
    """An exception raised inside, on a module with frozen or tied parameters, says which they are: a learner
    whose code meets `p.grad is None` (or a hook refused on a frozen tensor) learns why from one line."""
    if not frozen and not tied:
        yield
        return
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised with the module's shape added, where it is the cause
        text = str(exc)
        if isinstance(exc, NotImplementedError) or not ("None" in text or "require" in text):
            raise  # a stub ("not written yet"), a refused call: the line says it all
        what = [f"{name} is frozen (requires_grad=False: no hook, its .grad stays None)" for name in frozen]
        what += [f"{name} is {source} (one Parameter used by two layers, listed once by parameters())"
                 for name, source in tied]
        raise RuntimeError(f"{type(exc).__name__}: {text.splitlines()[0]} "
                           f"(in this case the module's {'; '.join(what)})") from exc


def _copies(named: dict) -> dict:
    """{name: a detached CPU copy of the tensor, or None}: what a model holds, as plain data."""
    return {name: None if t is None else t.detach().cpu().clone() for name, t in named.items()}


def in_place_list(fn: Callable, tensors: list, *args) -> dict:
    """fn(ts, *args) changes the tensors of list ts in place: send back those tensors afterwards.

    The tensors given, not what the list holds afterwards: replacing an entry is not in place.
    """
    device = rank_device()
    ts = [t.clone().to(device) for t in tensors]
    given = list(ts)
    returned = fn(ts, *args)
    return {"tensors": [t.detach().cpu().clone() for t in given], "returned": describe(returned)}


def _bucket_sizes(ddp_model) -> list[int]:
    """Elements in each of DDP's gradient buckets, in the order it reduces them.

    Read from the Reducer before the step: in its first iteration DDP puts every parameter
    in one bucket (torch 2.13); it rebuilds them by gradient order at the next forward.
    """
    return [bucket.buffer().numel() for bucket in ddp_model.reducer._get_zeros_like_grad_buckets()]


def ddp_accumulation(fn: Callable, weights: list, micro_batches: list, lr: float) -> dict:
    """fn(ddp_model, SGD(lr), micro_batches) makes one step; DDP's all-reduces go through the stock
    allreduce_hook, so the ledger records them. Send back the parameters and gradients afterwards."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    model = mlp_from_weights(weights).to(device)
    ddp_model = DistributedDataParallel(model)  # device_ids None: the model and the batches are on `device`
    # The same all-reduce DDP's C++ Reducer would issue, issued from Python (and so recorded).
    ddp_model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    buckets = _bucket_sizes(ddp_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    returned = fn(ddp_model, optimizer, _to(micro_batches, device))
    return {"params": _copies(dict(model.named_parameters())),
            "grads": _copies({n: p.grad for n, p in model.named_parameters()}),
            "buckets": buckets, "returned": describe(returned)}


# torch's own compression hooks: an exercise that asks for one written by hand refuses these.
_TORCH_COMPRESSION = ("_compress_hook", "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper",
                      "bf16_compress_wrapper")


def _torch_compression_in(fn: Callable) -> set[str]:
    """torch's compression hooks that `fn` is, or that the module defining it holds (imported by name)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = inspect.unwrap(fn)
    found = set()
    for value in [inner, *getattr(inner, "__globals__", {}).values()]:
        # fp16_compress_wrapper(hook) returns a closure defined in default_hooks, named after it.
        if getattr(value, "__module__", None) == default_hooks.__name__ and callable(value):
            name = getattr(value, "__qualname__", "").split(".")[0]
            if name in _TORCH_COMPRESSION:
                found.add(name)
    return found


def ddp_comm_hook(fn: Callable, weights: list, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """DDP with fn as its communication hook (state None: the default group), one backward on this
    rank's shard; send back the gradients, DDP's bucket sizes and any use of torch's own compression."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    used = _torch_compression_in(fn)
    device = rank_device()
    model = mlp_from_weights(weights).to(device)
    ddp_model = DistributedDataParallel(model)
    inputs, targets = inputs.to(device), targets.to(device)

    def hook(state, bucket):  # DDP checks a hook's parameter names and annotations: not the learner's
        return fn(state, bucket)

    ddp_model.register_comm_hook(None, hook)
    buckets = _bucket_sizes(ddp_model)
    # torch's hooks called through their module while the step runs (fp16_compress_hook calls _compress_hook).
    saved = {name: getattr(default_hooks, name) for name in _TORCH_COMPRESSION}

    def recording(name, original):
        def recorded(*args, **kwargs):
            used.add(name)
            return original(*args, **kwargs)
        return recorded

    for name, original in saved.items():
        setattr(default_hooks, name, recording(name, original))
    try:
        torch.nn.functional.mse_loss(ddp_model(inputs), targets).backward()
    finally:
        for name, original in saved.items():
            setattr(default_hooks, name, original)
    return {"grads": _copies({n: p.grad for n, p in model.named_parameters()}), "buckets": buckets,
            "torch_compression": sorted(used)}


class _WaitClock:
    """Records when anything waits for a collective (`Work.wait`, `Future.wait`), on this rank's clock.

    The ledger records when each all-reduce started; this records when the program waited for one,
    so a judge can tell a wait inside backward (no overlap) from one after it. A blocking call
    (`async_op=False`) waits inside torch.distributed, and is recorded too.
    """

    def __init__(self):
        from torch._C import _distributed_c10d as cpp

        self.times: list[float] = []
        self.saved = [(cpp.Work, "wait", cpp.Work.wait), (torch._C.Future, "wait", torch._C.Future.wait)]

    def __enter__(self):
        import time

        def recording(original):
            def wait(handle, *args, **kwargs):
                self.times.append(time.monotonic())
                return original(handle, *args, **kwargs)
            return wait

        for owner, name, original in self.saved:
            setattr(owner, name, recording(original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self.saved:
            setattr(owner, name, original)


def ddp_from_scratch(fn: Callable, weights: list, bucket_cap_bytes: int, steps: list, micro_batches: list,
                     lr: float, frozen=(), tied=()) -> dict:
    """model = fn(module, bucket_cap_bytes) (the learner's class), SGD(lr) over the module's parameters
    (`frozen` and `tied`: see mlp_from_weights):
    3 steps of forward, backward, model.finish_gradient_synchronization(), step, zero_grad on this
    rank's batches `steps`; then one step over 2 micro-batches, the first run inside model.no_sync().

    Sends back the parameters after construction and after each step, the gradients after each
    finish_gradient_synchronization() (and after the no_sync backward), when each phase began and
    ended, when the last gradient of each backward was ready (this driver's own hooks, registered
    before the learner's, so they run first) and when anything waited for a collective: all on
    the clock of the ledger's "start" times (time.monotonic).
    """
    import time

    cls = inspect.unwrap(fn)
    device = rank_device()
    module = mlp_from_weights(weights, frozen, [tuple(pair) for pair in tied]).to(device)
    steps, micro_batches = _to(steps, device), _to(micro_batches, device)
    ready_at: list[float] = []
    for parameter in module.parameters():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(lambda p: ready_at.append(time.monotonic()))
    loss_fn = torch.nn.functional.mse_loss
    out: dict = {"params": [], "grads": [], "times": []}

    def params() -> dict:
        return _copies(dict(module.named_parameters()))

    def grads() -> dict:
        return _copies({n: p.grad for n, p in module.named_parameters()})

    with _WaitClock() as waits, fn.learner_code(), shared_parameters_named(frozen, tied):
        model = cls(module, bucket_cap_bytes)
        out["start"] = params()
        optimizer = torch.optim.SGD(module.parameters(), lr=lr)
        for inputs, targets in steps:
            ready_at.clear()
            loss = loss_fn(model(inputs), targets)
            backward_start = time.monotonic()
            loss.backward()
            backward_end = time.monotonic()
            model.finish_gradient_synchronization()
            out["times"].append({"backward": (backward_start, backward_end), "finish_end": time.monotonic(),
                                 "last_ready": max(ready_at, default=backward_end)})
            out["grads"].append(grads())
            optimizer.step()
            optimizer.zero_grad()
            out["params"].append(params())
        (first_x, first_y), (last_x, last_y) = micro_batches
        no_sync_start = time.monotonic()
        with model.no_sync():
            (loss_fn(model(first_x), first_y) / 2).backward()
        no_sync_end = time.monotonic()
        out["no_sync"] = {"span": (no_sync_start, no_sync_end), "grads": grads()}
        (loss_fn(model(last_x), last_y) / 2).backward()
        model.finish_gradient_synchronization()
        out["no_sync"]["finish_end"] = time.monotonic()
        out["no_sync"]["synced_grads"] = grads()
        optimizer.step()
        optimizer.zero_grad()
        out["no_sync"]["params"] = params()
    out["waits"] = list(waits.times)
    return out
