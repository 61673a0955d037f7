"""The rank side of lesson 05: fully_shard (FSDP2): how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ...drivers import describe, rank_device, refused

__all__ = ["buffered_model", "fsdp2_accumulation", "fsdp2_hsdp", "fsdp2_meta_init", "fsdp2_shard", "placements_of",
           "tied_model", "toy_from_weights", "two_layers", "zero3_linear"]


def toy_from_weights(sizes: dict, weights: dict) -> torch.nn.Module:
    """course_lib.models.ToyModel(**sizes) holding copies of `weights` (a state dict)."""
    from ....models import ToyModel

    model = ToyModel(**sizes)
    model.load_state_dict(weights)
    return model


def _mesh_1d() -> object:
    """A 1-D mesh of every rank on the group's device (named: with gloo, a GPU's mesh would fail, pytorch#132471)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


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

    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def placements_of(model: torch.nn.Module) -> dict:
    """{name: what the parameter is, as plain data}: type, device, and a DTensor's placements and mesh."""
    from torch.distributed.tensor import DTensor

    described = {}
    for name, p in model.named_parameters():
        entry = {"type": type(p).__name__ if not isinstance(p, DTensor) else "DTensor", "device": p.device.type}
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            entry.update(placements=[repr(x) for x in p.placements], mesh_shape=list(mesh.shape),
                         mesh_ranks=mesh.mesh.flatten().tolist(), mesh_device=mesh.device_type,
                         mesh_names=list(mesh.mesh_dim_names or ()), coordinate=list(mesh.get_coordinate() or ()))
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
            "those DTensors for tensor-parallel ones and fails. Shard bottom up: the root last "
            "(it keeps only the parameters no group below took)")
    mesh = _mesh_in(exc.__traceback__)
    if mesh is not None and dist.is_initialized():
        ranks = mesh.mesh.flatten().tolist()
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank not in ranks or len(ranks) != world:
            return RuntimeError(
                f"{said}: the mesh holds ranks {ranks}, {len(ranks)} of the {world} ranks (rank {rank} "
                f"{'is not' if rank not in ranks else 'is'} in it); FSDP's 1-D mesh holds every rank: "
                "init_device_mesh(device_type, (dist.get_world_size(),)), not a size written in the code")
    return None


def tied_model(sizes: dict) -> torch.nn.Module:
    """05.shard_bottom_up's model: embed = Embedding(vocab, dim); stages, a ModuleList of Sequentials of
    Block(dim, hidden) (`sizes["stages"]` Blocks each); norm = LayerNorm(dim); head = Linear(dim, vocab,
    bias=False) whose weight IS embed.weight (tied). (batch,) token ids -> (batch, vocab)."""
    from ....models import Block

    class TiedModel(torch.nn.Module):
        def __init__(self, vocab: int, dim: int, hidden: int, stages: list):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.stages = torch.nn.ModuleList(torch.nn.Sequential(*(Block(dim, hidden) for _ in range(count)))
                                              for count in stages)
            self.norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.embed.weight  # one Parameter, two modules

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for stage in self.stages:
                x = stage(x)
            return self.head(self.norm(x))

    return TiedModel(**sizes)


def fsdp2_shard(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
                lr: float) -> dict:
    """fn(model) applies fully_shard to tied_model(sizes) holding `weights`; then one SGD(lr) step on this rank's
    rows. Send back the modules that are FSDP modules, which of them share one FSDP state (a group made by one
    fully_shard call), whether the tie survived, every parameter's type and placements, when the forward ran (to
    find its all-gathers in the ledger) and this rank's rows of each parameter after the step."""
    import time

    from torch.distributed.fsdp import FSDPModule

    device = rank_device()
    model = tied_model(sizes)
    model.load_state_dict(weights)
    model = model.to(device)
    inputs, targets = inputs.to(device), targets.to(device)
    try:
        returned = fn(model)
    except Exception as exc:
        explained = _explained_sharding_error(exc, model)
        if explained is None:
            raise
        raise explained from exc
    named = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    states = [id(module._get_fsdp_state()) for _, module in named]
    groups = [[name for (name, _), state in zip(named, states) if state == key] for key in dict.fromkeys(states)]
    described = placements_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    started = time.monotonic()
    try:
        outputs = model(inputs)
    except ValueError as exc:
        # torch checks for a Parameter held by two groups in the root's lazy init, i.e. at the first forward,
        # not in fully_shard: embed and head sharded one after the other fail here
        if "already managed by another FSDP group" not in str(exc):
            raise
        raise RuntimeError(
            f"{str(exc).split('. ')[0]}: embed and head hold one Parameter; fully_shard(model.embed) put it in "
            "embed's group and fully_shard(model.head) made a second group holding it too (torch finds that at the "
            "first forward). Shard the tied pair by one call, together") from exc
    forward = [started, time.monotonic()]
    torch.nn.functional.mse_loss(outputs, targets).backward()
    optimizer.step()
    return {"units": [name for name, _ in named], "groups": groups, "tied": model.head.weight is model.embed.weight,
            "params": described, "forward": forward, "shards": _local_shards(model), "returned": describe(returned)}


def two_layers(features: int, hidden: int, out: int) -> torch.nn.Module:
    """Linear(features, hidden) -> ReLU -> Linear(hidden, out): 05.zero3_linear's model in one process (its
    state dict's keys are 0.* and 2.*)."""
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out))


def _linear(weights: dict, prefix: str) -> torch.nn.Linear:
    out_features, in_features = weights[f"{prefix}.weight"].shape
    linear = torch.nn.Linear(in_features, out_features)
    linear.load_state_dict({"weight": weights[f"{prefix}.weight"], "bias": weights[f"{prefix}.bias"]})
    return linear


def _layer_problem(module: object, linear_shape: tuple, rows: int) -> str:
    """"" if `module` holds Parameters `weight` [rows, in] and `bias` [rows]; else what it holds instead."""
    if not isinstance(module, torch.nn.Module):
        return f"ShardedLinear(...) made a {describe(module)}, not an nn.Module"
    expected = {"weight": [rows, linear_shape[1]], "bias": [rows]}
    held = {name: list(p.shape) for name, p in module.named_parameters()}
    if held != expected:
        shown = ", ".join(f"{name} {shape}" for name, shape in held.items()) or "none"
        return (f"ShardedLinear(Linear({linear_shape[1]}, {linear_shape[0]})) holds the parameters {shown}, expected "
                f"exactly weight {expected['weight']} and bias {expected['bias']}: this rank's rows, as Parameters")
    return ""


def _made_during(fn: Callable[[], object]) -> tuple[object, list[int]]:
    """Run fn(); return its result and the bytes of every storage made by an operation during it (aten ops and
    the collectives' outputs, seen by a TorchDispatchMode) that is still alive once it has returned. A tensor
    kept anywhere (on autograd's ctx as an attribute, on a module, in a global) is still alive; one that only
    lived inside fn is not. Saved-tensor hooks see only what autograd saves; this sees the rest."""
    import gc
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made: list = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Made():
        result = fn()
    gc.collect()  # a reference cycle that only fn's frames held is not "kept"
    alive = {}
    for ref in made:
        tensor = ref()
        if tensor is not None:
            storage = tensor.untyped_storage()
            alive[storage.data_ptr()] = storage.nbytes()
    return result, sorted(alive.values(), reverse=True)


def zero3_linear(fn: Callable, weights: dict, inputs: torch.Tensor, targets: torch.Tensor, lr: float,
                 steps: int) -> dict:
    """`fn` is the learner's ShardedLinear class. Build Sequential(ShardedLinear(Linear 0), ReLU, ShardedLinear(
    Linear 2)) from the full Linears holding `weights` (the same on every rank), run `steps` SGD(lr) steps on
    this rank's rows (inputs that require grad, as a layer inside a model gets). Send back the first forward's
    output, what autograd saved during it (shapes), the bytes of each storage the forward made that is still
    alive after it (`_made_during`), when the first forward and backward ran (for the ledger),
    the shards' first gradients, and the shards after the steps. The whole block counts as the learner's code."""
    import time

    import torch.distributed as dist

    cls, world, device = inspect.unwrap(fn), dist.get_world_size(), rank_device()
    inputs, targets = inputs.to(device), targets.to(device)
    saved: list[list[int]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(list(tensor.shape))
        return tensor

    with fn.learner_code():
        layers = []
        for prefix in ("0", "2"):
            linear = _linear(weights, prefix).to(device)
            layers.append(cls(linear))
            problem = _layer_problem(layers[-1], tuple(linear.weight.shape), linear.out_features // world)
            if problem:
                return {"problem": problem}
        del linear  # the whole Linear lives on only if the learner's module kept it
        model = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1])
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        x = inputs.clone().requires_grad_()
        started = time.monotonic()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            outputs, kept = _made_during(lambda: model(x))
        forward = [started, time.monotonic()]
        torch.nn.functional.mse_loss(outputs, targets).backward()
        backward = [forward[1], time.monotonic()]
        grads = {name: p.grad.detach().cpu().clone() if isinstance(p.grad, torch.Tensor) else describe(p.grad)
                 for name, p in model.named_parameters()}
        optimizer.step()
        for _ in range(steps - 1):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
    return {"outputs": outputs.detach().cpu().clone(), "saved": saved, "kept": kept, "forward": forward,
            "backward": backward, "grads": grads,
            "params": {name: p.detach().cpu().clone() for name, p in model.named_parameters()}}


def fsdp2_hsdp(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor, lr: float,
               shard_size: int, steps: int) -> dict:
    """fn(model, shard_size) shards ToyModel(**sizes) holding `weights` over a 2-D mesh it builds and returns.
    Send back the mesh (shape, dim names, this rank's group and coordinate in each dim), the FSDP modules,
    every parameter's placements, when each of `steps` SGD(lr) steps ran (for the ledger) and this rank's
    rows of each parameter afterwards."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    device = rank_device()
    model = toy_from_weights(sizes, weights).to(device)
    inputs, targets = inputs.to(device), targets.to(device)
    mesh = fn(model, shard_size)
    if not isinstance(mesh, DeviceMesh):
        return {"returned": describe(mesh)}
    groups = [dist.get_process_group_ranks(mesh.get_group(dim)) for dim in range(mesh.ndim)]
    described = {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names or ()), "groups": groups,
                 "coordinate": list(mesh.get_coordinate() or ())}
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    params = placements_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    spans = []
    for _ in range(steps):
        started = time.monotonic()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        spans.append([started, time.monotonic()])
    return {"mesh": described, "units": units, "params": params, "steps": spans, "shards": _local_shards(model)}


def fsdp2_accumulation(fn: Callable, sizes: dict, weights: dict, micro_batches: list, lr: float) -> dict:
    """ToyModel(**sizes) holding `weights`, fully_shard on each Block and the root; fn(model, SGD(lr),
    micro_batches) makes one step. Send back this rank's rows of each parameter afterwards and when each
    forward of the root started (to tell the micro-batches' collectives apart in the ledger)."""
    import time

    device = rank_device()
    model = toy_from_weights(sizes, weights).to(device)
    _shard_toy(model)
    starts: list[float] = []
    model.register_forward_pre_hook(lambda module, args: starts.append(time.monotonic()), prepend=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    returned = fn(model, optimizer, [tuple(t.to(device) for t in pair) for pair in micro_batches])
    # A group left unsharded has its whole parameters registered on the module, plain tensors, not DTensors.
    from torch.distributed.tensor import DTensor

    gathered = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    # The statement asks for the gradients zeroed after the step: None, or all zeros.
    kept = [name for name, p in model.named_parameters() if p.grad is not None and bool(
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).any())]
    return {"shards": _local_shards(model), "starts": starts, "returned": describe(returned), "grads_kept": kept,
            "gathered": gathered}


def buffered_model(sizes: dict) -> torch.nn.Module:
    """05.meta_init_broadcast's model: scale (a Scale(dim): x * freq + shift), `layers` Blocks (`blocks`), head
    Linear(dim, out). `scale.freq` = FREQ_BASE ** (-arange(dim) / dim), a buffer outside the state dict
    (persistent=False, computed in __init__); `scale.shift`, a buffer in it. (batch, dim) -> (batch, out)."""
    from ....models import Block

    class Scale(torch.nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.register_buffer("freq", FREQ_BASE ** (-torch.arange(dim, dtype=torch.float32) / dim),
                                 persistent=False)
            self.register_buffer("shift", torch.zeros(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.freq + self.shift

    class BufferedModel(torch.nn.Module):
        def __init__(self, dim: int, hidden: int, layers: int, out: int):
            super().__init__()
            self.scale = Scale(dim)
            self.blocks = torch.nn.ModuleList(Block(dim, hidden) for _ in range(layers))
            self.head = torch.nn.Linear(dim, out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.scale(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return BufferedModel(**sizes)


FREQ_BASE = 100.0  # scale.freq's base
# What 05.meta_init_broadcast asks the learner to build: the distributed state dict's loaders, refused while it runs.
_LOADERS = tuple(("torch.distributed.checkpoint.state_dict", name, name) for name in
                 ("set_model_state_dict", "set_state_dict"))


def fsdp2_meta_init(fn: Callable, sizes: dict, full_state: dict, seed: int, inputs: torch.Tensor) -> dict:
    """fn(build, full_state) builds buffered_model(sizes) with `build()`, shards it and fills it from rank 0's
    `full_state` ({} on the other ranks); every rank's random state is seeded with `seed` first, as a training
    script would. Send back the device build() made its parameters on, the returned model's parameters, its
    buffers and its output on `inputs`."""
    built_on: list[str] = []

    def build() -> torch.nn.Module:
        model = buffered_model(sizes)
        built_on.append(next(model.parameters()).device.type)
        return model

    torch.manual_seed(seed)
    try:
        with refused(*_LOADERS):
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
    described, shards = placements_of(model), _local_shards(model)  # before the forward: the root stays gathered
    buffers = {name: b.detach().cpu().clone() for name, b in model.named_buffers()}
    with torch.no_grad():
        outputs = model(inputs.to(rank_device())).detach().cpu().clone() if all(
            b.device.type != "meta" for b in model.buffers()) else None
    return {"built_on": built_on, "params": described, "shards": shards, "buffers": buffers, "outputs": outputs}
