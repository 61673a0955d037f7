"""How a rank calls the learner's function for one case, and what it sends back to the checker.

Runs on the ranks, in the learner's process. A driver copies the inputs it
passes (so a function that modifies its argument cannot touch the checker's
view of the inputs) and returns plain data: tensors, lists, dicts, numbers,
strings. That is all `torch.load(weights_only=True)` accepts on the checker's
side, so nothing the learner's code builds is ever unpickled by the grader.
A return value of the wrong type is described in words, for the judge to report.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

__all__ = ["DRIVERS", "mlp_from_weights", "toy_from_weights", "wrap_model"]


def _describe(value: Any) -> str:
    return f"{type(value).__name__}"


def in_place(fn: Callable, tensor: torch.Tensor) -> dict:
    """fn(t) changes t in place: send back t afterwards (and what fn returned, by type)."""
    t = tensor.clone()
    returned = fn(t)
    return {"tensor": t, "returned": _describe(returned)}


def returns_tensor_list(fn: Callable, tensor: torch.Tensor) -> dict:
    """fn(t) returns a list of tensors: send back the list (copied) and t afterwards."""
    t = tensor.clone()
    returned = fn(t)
    if not isinstance(returned, (list, tuple)) or not all(isinstance(x, torch.Tensor) for x in returned):
        return {"not_a_tensor_list": _describe(returned), "input_after": t}
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
        return {"not_a_pair": _describe(returned)}
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


# ---------------------------------------------------------------- lesson 02: gradients and DDP


def mlp_from_weights(weights: list[torch.Tensor]) -> torch.nn.Sequential:
    """Linear -> ReLU -> Linear holding copies of `weights` = [0.weight, 0.bias, 2.weight, 2.bias], float32.

    The checker builds its single-process reference from the same call, so both hold the same values.
    """
    hidden, features = weights[0].shape
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, weights[2].shape[0]))
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), weights):
            parameter.copy_(value)
    return model


def _copies(named: dict) -> dict:
    """{name: a detached copy of the tensor, or None}: what a model holds, as plain data."""
    return {name: None if t is None else t.detach().clone() for name, t in named.items()}


def average_gradients(fn: Callable, weights: list, inputs: torch.Tensor, targets: torch.Tensor,
                      frozen: list[str]) -> dict:
    """This rank's backward on its shard (mse_loss), then fn(model): send back every .grad (None stays None)."""
    model = mlp_from_weights(weights)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name not in frozen)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    returned = fn(model)
    return {"grads": _copies({n: p.grad for n, p in model.named_parameters()}), "returned": _describe(returned)}


def in_place_list(fn: Callable, tensors: list, *args) -> dict:
    """fn(ts, *args) changes the tensors of list ts in place: send back those tensors afterwards.

    The tensors given, not what the list holds afterwards: replacing an entry is not in place.
    """
    ts = [t.clone() for t in tensors]
    given = list(ts)
    returned = fn(ts, *args)
    return {"tensors": [t.detach().clone() for t in given], "returned": _describe(returned)}


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

    model = mlp_from_weights(weights)
    ddp_model = DistributedDataParallel(model)
    # The same all-reduce DDP's C++ Reducer would issue, issued from Python (and so recorded).
    ddp_model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    buckets = _bucket_sizes(ddp_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    returned = fn(ddp_model, optimizer, [tuple(pair) for pair in micro_batches])
    return {"params": _copies(dict(model.named_parameters())),
            "grads": _copies({n: p.grad for n, p in model.named_parameters()}),
            "buckets": buckets, "returned": _describe(returned)}


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
    model = mlp_from_weights(weights)
    ddp_model = DistributedDataParallel(model)

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


# ---------------------------------------------------------------- lesson 03: uneven inputs, Join, ZeRO


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


def ddp_join_training(fn: Callable, weights: list, batches: list, lr: float) -> dict:
    """fn(ddp_model, SGD(lr), batches) trains on this rank's batches (their number differs per rank).

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
        returned = fn(ddp_model, optimizer, [tuple(pair) for pair in batches])
    finally:
        ddp_module.Join = join
    return {"params": _copies(dict(model.named_parameters())), "returned": _describe(returned)}


def counting_joinable(fn: Callable, iterations: int) -> dict:
    """`fn` is the learner's Joinable class: counter = fn(); with Join([counter]) (torch's, imported
    here), call counter() `iterations` times (the number differs per rank). Send back counter.count
    and counter.is_last_joiner afterwards. The whole block counts as the learner's code for a deadline."""
    from torch.distributed.algorithms.join import Join, Joinable

    cls = inspect.unwrap(fn)
    with fn.learner_code():
        counter = cls()
        if not isinstance(counter, Joinable):
            return {"not_joinable": _describe(counter)}
        with Join([counter]):
            for _ in range(iterations):
                counter()
    count = getattr(counter, "count", None)
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        count = float(count.item())
    elif not isinstance(count, (int, float)) or isinstance(count, bool):
        count = _describe(count)
    last = getattr(counter, "is_last_joiner", None)
    return {"count": float(count) if isinstance(count, int) else count,
            "is_last_joiner": last if isinstance(last, bool) or last is None else _describe(last)}


def zero_save(fn: Callable, weights: list, steps: list, lr: float, file_name: str) -> dict:
    """DDP and ZeroRedundancyOptimizer(Adam, lr) take one step per (inputs, targets) of `steps` (this
    rank's shard), then fn(optimizer, path) saves; `path` is `file_name` in the run's working folder,
    the same on every rank. Send back the bytes rank 0 finds at `path` right after fn returns."""
    import os

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = mlp_from_weights(weights)
    ddp_model = DistributedDataParallel(model)
    ddp_model.register_comm_hook(dist.group.WORLD, allreduce_hook)  # the ledger records the all-reduces
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    for inputs, targets in steps:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp_model(inputs), targets).backward()
        optimizer.step()
    path = os.path.join(os.getcwd(), file_name)
    returned = fn(optimizer, path)
    saved = None
    if dist.get_rank() == 0 and os.path.isfile(path):
        with open(path, "rb") as handle:
            data = handle.read()
        saved = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return {"saved": saved, "returned": _describe(returned)}


# ---------------------------------------------------------------- lesson 04: FullyShardedDataParallel (FSDP1)


def _fsdp(model: torch.nn.Module, **kwargs):
    """FSDP1 (FULL_SHARD, use_orig_params=False: its defaults) over the default group, on the CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=torch.device("cpu"), **kwargs)  # without device_id FSDP1 asks for a GPU


def wrap_model(sizes: dict) -> torch.nn.Module:
    """04.wrap_policy's model: stem (Linear(features, width) -> ReLU -> Linear(width, dim)), `layers` Blocks
    (course_lib.models.Block(dim, hidden)), head Linear(dim, out). (batch, features) -> (batch, out)."""
    from ..models import Block

    class WrapModel(torch.nn.Module):
        def __init__(self, features: int, width: int, dim: int, hidden: int, layers: int, out: int):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Linear(features, width), torch.nn.ReLU(),
                                            torch.nn.Linear(width, dim))
            self.blocks = torch.nn.ModuleList(Block(dim, hidden) for _ in range(layers))
            self.head = torch.nn.Linear(dim, out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return WrapModel(**sizes)


def toy_from_weights(sizes: dict, weights: dict) -> torch.nn.Module:
    """course_lib.models.ToyModel(**sizes) holding copies of `weights` (a state dict)."""
    from ..models import ToyModel

    model = ToyModel(**sizes)
    model.load_state_dict(weights)
    return model


def _full_params(fsdp_model) -> dict:
    """{name: parameter}, the whole of each, gathered (summon_full_params all-gathers every unit's shards)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ..measure.sharding import clean_name

    with FSDP.summon_full_params(fsdp_model, writeback=False):
        return {clean_name(n): p.detach().clone() for n, p in fsdp_model.named_parameters()}


def _sgd(fsdp_model, steps: list, lr: float) -> None:
    optimizer = torch.optim.SGD(fsdp_model.parameters(), lr=lr)
    for inputs, targets in steps:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(fsdp_model(inputs), targets).backward()
        optimizer.step()


def fsdp_wrap_policy(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
                     lr: float) -> dict:
    """FSDP(wrap_model(sizes), auto_wrap_policy=fn), then one SGD(lr) step on this rank's shard of the batch.
    Send back the names of the modules that became FSDP units and the whole parameters after the step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ..measure.sharding import clean_name

    model = wrap_model(sizes)
    model.load_state_dict(weights)

    def policy(module, recurse, nonwrapped_numel):  # FSDP calls it with keywords: not the learner's names
        return fn(module, recurse, nonwrapped_numel)

    fsdp_model = _fsdp(model, auto_wrap_policy=policy)
    units = [clean_name(name) for name, module in fsdp_model.named_modules() if isinstance(module, FSDP)]
    _sgd(fsdp_model, [(inputs, targets)], lr)
    return {"units": units, "params": _full_params(fsdp_model)}


def fsdp_flat_shard(fn: Callable, shapes: list) -> dict:
    """FSDP over one module holding parameters of `shapes` (one unit, one FlatParameter); send back
    fn(numels, world_size) and what this rank's shard really holds (measure.sharding reads it)."""
    import math

    import torch.distributed as dist

    from ..measure.sharding import sharding_of

    module = torch.nn.Module()
    for index, shape in enumerate(shapes):
        module.register_parameter(f"p{index}", torch.nn.Parameter(torch.zeros(shape)))
    flat = sharding_of(_fsdp(module))["flat"][0]
    returned = fn([math.prod(shape) for shape in shapes], dist.get_world_size())
    if isinstance(returned, (list, tuple)) and len(returned) == 2 and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in returned):
        answer = [int(x) for x in returned]
    else:
        answer = _describe(returned) + (f" of {len(returned)}" if isinstance(returned, (list, tuple)) else "")
    return {"answer": answer, "shard_numel": flat["shard_numel"], "padding": flat["padding"],
            "unsharded_numel": flat["unsharded_numel"]}


def _flat_units(fsdp_model) -> list:
    """One dict per FlatParameter this rank holds: measure.sharding's layout and the flat gradient's shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ..measure.sharding import sharding_of

    flats = sharding_of(fsdp_model)["flat"]
    handles = [m._handle for m in fsdp_model.modules() if isinstance(m, FSDP) and m._handle is not None]
    for flat, handle in zip(flats, handles):  # both in named_modules order
        grad = handle.flat_param.grad
        flat["grad"] = None if grad is None else grad.detach().clone()
    return flats


def fsdp_clip(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
              max_norm: float) -> dict:
    """FSDP(ToyModel, one unit per Block) and one backward on this rank's shard of the batch; then
    fn(fsdp_model, max_norm). Send back what fn returned (a number), this rank's own shard norm before
    the call and every FlatParameter's gradient shard afterwards."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ..models import Block

    fsdp_model = _fsdp(toy_from_weights(sizes, weights), auto_wrap_policy=ModuleWrapPolicy({Block}))
    torch.nn.functional.mse_loss(fsdp_model(inputs), targets).backward()
    local = torch.stack([p.grad.double().square().sum() for p in fsdp_model.parameters()]).sum().sqrt()
    returned = fn(fsdp_model, max_norm)
    if isinstance(returned, torch.Tensor) and returned.numel() == 1:
        norm = float(returned.item())
    elif isinstance(returned, (int, float)) and not isinstance(returned, bool):
        norm = float(returned)
    else:
        norm = _describe(returned)
    return {"norm": norm, "local_norm": float(local), "flats": _flat_units(fsdp_model)}


def _describe_file(path: str) -> dict | None:
    """What a file holds, as plain data: its bytes and, read here (in the learner's process, where its
    classes live), its keys and value types. None if there is no file."""
    import os

    if not os.path.isfile(path):
        return None
    with open(path, "rb") as handle:
        data = handle.read()
    described = {"bytes": torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                 else torch.zeros(0, dtype=torch.uint8)}
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - not a file torch.save wrote
        described["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return described
    if isinstance(state, dict):
        described["keys"] = [str(k) for k in state]
        described["types"] = sorted({type(v).__name__ for v in state.values()})
    else:
        described["type"] = _describe(state)
    return described


def fsdp_save(fn: Callable, sizes: dict, weights: dict, steps: list, lr: float, file_name: str) -> dict:
    """FSDP(ToyModel, one unit per Block) takes one SGD(lr) step per (inputs, targets) of `steps` (this
    rank's shard); then fn(fsdp_model, path), `path` being `file_name` in a folder of this rank's own.
    Send back what each rank finds at its path right after fn returns."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ..models import Block

    fsdp_model = _fsdp(toy_from_weights(sizes, weights), auto_wrap_policy=ModuleWrapPolicy({Block}))
    _sgd(fsdp_model, [tuple(pair) for pair in steps], lr)
    folder = os.path.join(os.getcwd(), f"rank{dist.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name)
    try:
        returned = fn(fsdp_model, path)
    except RuntimeError as exc:
        # NOTE: FullStateDictConfig(offload_to_cpu=True) on a model already on the CPU frees the gathered
        # parameters before state_dict() reads them (torch 2.13: https://github.com/pytorch/pytorch/issues/188989);
        # torch's message names only a storage size.
        if "out of bounds for storage of size 0" not in str(exc):
            raise
        raise RuntimeError(f"{str(exc).splitlines()[0]}: FullStateDictConfig(offload_to_cpu=True) on a model on the "
                           "CPU frees the gathered parameters before they are read (pytorch/pytorch#188989); "
                           "offload only from a GPU (offload_to_cpu=False here)") from exc
    return {"file": _describe_file(path), "returned": _describe(returned)}


# ---------------------------------------------------------------- lesson 05: fully_shard (FSDP2)


def _mesh_1d() -> object:
    """A 1-D mesh of every rank on the CPU (explicit: with gloo, a GPU's mesh would fail, pytorch#132471)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard_toy(model: torch.nn.Module) -> None:
    """fully_shard on each Block, then on the root (05.shard_bottom_up's answer), over `_mesh_1d()`."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh_1d()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _local_shards(model: torch.nn.Module) -> dict:
    """{name: this rank's rows of the parameter (a DTensor's local tensor; the whole tensor if not a DTensor)}."""
    from torch.distributed.tensor import DTensor

    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def _placements(model: torch.nn.Module) -> dict:
    """{name: what the parameter is, as plain data}: type, device, and a DTensor's placements and mesh."""
    from torch.distributed.tensor import DTensor

    described = {}
    for name, p in model.named_parameters():
        entry = {"type": type(p).__name__ if not isinstance(p, DTensor) else "DTensor", "device": p.device.type}
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            entry.update(placements=[repr(x) for x in p.placements], mesh_shape=list(mesh.shape),
                         mesh_ranks=mesh.mesh.flatten().tolist(), mesh_device=mesh.device_type)
        described[name] = entry
    return described


def _mesh_in(tb) -> object | None:
    """The DeviceMesh a traceback's frames hold in a local variable (the innermost), or None."""
    from torch.distributed.device_mesh import DeviceMesh

    found = None
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, DeviceMesh):
                found = value
        tb = tb.tb_next
    return found


def _explained_sharding_error(exc: Exception, model: torch.nn.Module) -> Exception | None:
    """A clearer error for what torch raises when fully_shard is applied top-down or over a mesh
    this rank is not in (torch 2.13 and 2.15 name neither); None if `exc` is neither."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ..models import Block

    text = str(exc).splitlines()[0] if str(exc) else ""
    said = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if isinstance(model, FSDPModule) and any(not isinstance(b, FSDPModule) for b in blocks):
        return RuntimeError(
            f"{said}: fully_shard(model) ran before fully_shard on the Blocks. The root's call already made every "
            "parameter below it, the Blocks' too, a DTensor of the root's group; fully_shard on a Block then takes "
            "those DTensors for tensor-parallel ones and fails. Shard bottom up: each Block first, the root last "
            "(it keeps only the parameters no Block took)")
    mesh = _mesh_in(exc.__traceback__)
    if mesh is not None and dist.is_initialized():
        ranks = mesh.mesh.flatten().tolist()
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank not in ranks or len(ranks) != world:
            return RuntimeError(
                f"{said}: the mesh holds ranks {ranks}, {len(ranks)} of the {world} ranks (rank {rank} "
                f"{'is not' if rank not in ranks else 'is'} in it); FSDP's 1-D mesh holds every rank: "
                "init_device_mesh('cpu', (dist.get_world_size(),)), not a size written in the code")
    return None


def fsdp2_shard(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
                lr: float) -> dict:
    """fn(model) applies fully_shard to ToyModel(**sizes) holding `weights`; then one SGD(lr) step on this rank's
    rows. Send back the modules that are FSDP modules, every parameter's type and placements, when the forward
    ran (to find its all-gathers in the ledger) and this rank's rows of each parameter after the step."""
    import time

    from torch.distributed.fsdp import FSDPModule

    model = toy_from_weights(sizes, weights)
    try:
        returned = fn(model)
    except Exception as exc:
        explained = _explained_sharding_error(exc, model)
        if explained is None:
            raise
        raise explained from exc
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    described = _placements(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    started = time.monotonic()
    outputs = model(inputs)
    forward = [started, time.monotonic()]
    torch.nn.functional.mse_loss(outputs, targets).backward()
    optimizer.step()
    return {"units": units, "params": described, "forward": forward, "shards": _local_shards(model),
            "returned": _describe(returned)}


def _fully_shard_linear_grads(weights: dict, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    """fully_shard(nn.Linear holding `weights`), one backward of mse_loss on this rank's rows: this rank's
    gradient shards (the local tensors of weight.grad and bias.grad), what 05.zero3_linear must equal."""
    from torch.distributed.fsdp import fully_shard

    out_features, in_features = weights["weight"].shape
    linear = torch.nn.Linear(in_features, out_features)
    linear.load_state_dict(weights)
    fully_shard(linear, mesh=_mesh_1d())
    torch.nn.functional.mse_loss(linear(inputs), targets).backward()
    return [p.grad.to_local().detach().clone() for p in (linear.weight, linear.bias)]


def zero3_linear(fn: Callable, weights: dict, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """fn(weight_shard, bias_shard, inputs, targets) with this rank's dim-0 rows of the Linear's weight and
    bias returns this rank's rows of the gradient averaged over the ranks. Send back what it returned, what
    fully_shard gives on the same Linear and rows, the shards afterwards, and when fn ran (for the ledger)."""
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = weights["weight"].shape[0] // world  # the cases' out_features divide by the world size: no padding
    fsdp = _fully_shard_linear_grads(weights, inputs, targets)
    shards = [weights[name][rank * rows:(rank + 1) * rows].clone() for name in ("weight", "bias")]
    started = time.monotonic()
    returned = fn(*shards, inputs.clone(), targets.clone())
    span = [started, time.monotonic()]
    if isinstance(returned, (list, tuple)) and len(returned) == 2 and \
            all(isinstance(x, torch.Tensor) for x in returned):
        grads = [x.detach().clone() for x in returned]
    else:
        grads = _describe(returned) + (f" of {len(returned)}" if isinstance(returned, (list, tuple)) else "")
    return {"grads": grads, "fsdp": fsdp, "after": [s.detach().clone() for s in shards], "span": span}


def fsdp2_accumulation(fn: Callable, sizes: dict, weights: dict, micro_batches: list, lr: float) -> dict:
    """ToyModel(**sizes) holding `weights`, fully_shard on each Block and the root; fn(model, SGD(lr),
    micro_batches) makes one step. Send back this rank's rows of each parameter afterwards and when each
    forward of the root started (to tell the micro-batches' collectives apart in the ledger)."""
    import time

    model = toy_from_weights(sizes, weights)
    _shard_toy(model)
    starts: list[float] = []
    model.register_forward_pre_hook(lambda module, args: starts.append(time.monotonic()), prepend=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    returned = fn(model, optimizer, [tuple(pair) for pair in micro_batches])
    return {"shards": _local_shards(model), "starts": starts, "returned": _describe(returned)}


def fsdp2_meta_init(fn: Callable, sizes: dict, full_state: dict, seed: int) -> dict:
    """fn(build, full_state) builds ToyModel(**sizes) with `build()`, shards it and fills it from rank 0's
    `full_state` ({} on the other ranks); every rank's random state is seeded with `seed` first, as a training
    script would. Send back the device build() made its parameters on, and the returned model's parameters."""
    from ..models import ToyModel

    built_on: list[str] = []

    def build() -> torch.nn.Module:
        model = ToyModel(**sizes)
        built_on.append(next(model.parameters()).device.type)
        return model

    torch.manual_seed(seed)
    try:
        model = fn(build, {name: value.clone() for name, value in full_state.items()})
    except RuntimeError as exc:
        # torch's words on a rank given {} without broadcast_from_rank0 name neither the rank's role nor the option.
        if "state_dict is empty" not in str(exc):
            raise
        raise RuntimeError(f"{str(exc).splitlines()[0]}: only rank 0 is given the full state dict ({{}} on the "
                           "others); StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) makes rank 0 "
                           "broadcast each tensor, and every rank keeps its own rows of it") from exc
    if not isinstance(model, torch.nn.Module):
        return {"built_on": built_on, "returned": _describe(model)}
    return {"built_on": built_on, "params": _placements(model), "shards": _local_shards(model)}


DRIVERS: dict[str, Callable[..., Any]] = {
    "in_place": in_place,
    "returns_tensor_list": returns_tensor_list,
    "process_groups": process_groups,
    "average_gradients": average_gradients,
    "in_place_list": in_place_list,
    "ddp_accumulation": ddp_accumulation,
    "ddp_comm_hook": ddp_comm_hook,
    "ddp_join_training": ddp_join_training,
    "counting_joinable": counting_joinable,
    "zero_save": zero_save,
    "fsdp_wrap_policy": fsdp_wrap_policy,
    "fsdp_flat_shard": fsdp_flat_shard,
    "fsdp_clip": fsdp_clip,
    "fsdp_save": fsdp_save,
    "fsdp2_shard": fsdp2_shard,
    "zero3_linear": zero3_linear,
    "fsdp2_accumulation": fsdp2_accumulation,
    "fsdp2_meta_init": fsdp2_meta_init,
}
