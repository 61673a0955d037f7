"""The rank side of lesson 05: fully_shard (FSDP2): how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...drivers import describe
from ..lesson04.drivers import toy_from_weights

__all__ = ['fsdp2_shard', 'zero3_linear', 'fsdp2_accumulation', 'fsdp2_meta_init']


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

    from ....models import Block

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
            "returned": describe(returned)}


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
        grads = describe(returned) + (f" of {len(returned)}" if isinstance(returned, (list, tuple)) else "")
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
    return {"shards": _local_shards(model), "starts": starts, "returned": describe(returned)}


def fsdp2_meta_init(fn: Callable, sizes: dict, full_state: dict, seed: int) -> dict:
    """fn(build, full_state) builds ToyModel(**sizes) with `build()`, shards it and fills it from rank 0's
    `full_state` ({} on the other ranks); every rank's random state is seeded with `seed` first, as a training
    script would. Send back the device build() made its parameters on, and the returned model's parameters."""
    from ....models import ToyModel

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
        return {"built_on": built_on, "returned": describe(model)}
    return {"built_on": built_on, "params": _placements(model), "shards": _local_shards(model)}
