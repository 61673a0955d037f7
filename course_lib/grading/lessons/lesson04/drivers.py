"""The rank side of lesson 04: FullyShardedDataParallel (FSDP1): how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...drivers import describe, rank_device, refused

__all__ = ['wrap_model', 'toy_from_weights', 'fsdp_wrap_policy', 'fsdp_flat_shard', 'fsdp_clip', 'fsdp_load', 'fsdp_memory']


def _fsdp(model: torch.nn.Module, **kwargs):
    """FSDP1 (FULL_SHARD, use_orig_params=False: its defaults) over the default group, on this rank's device."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=rank_device(), **kwargs)  # moves the model there; on a CPU FSDP1 needs it said


def wrap_model(sizes: dict) -> torch.nn.Module:
    """04.wrap_policy's model: embed (Sequential(Linear(features, dim), LayerNorm(dim))), `layers` Blocks
    (course_lib.models.Block(dim, hidden)), norm LayerNorm(dim), head (Sequential(Linear(dim, dim), ReLU(),
    Linear(dim, out))); the modules named in sizes["frozen"] have requires_grad=False (a fine-tuning run's
    pretrained parts). (batch, features) -> (batch, out)."""
    from ....models import Block

    class PartlyFrozen(torch.nn.Module):
        def __init__(self, features: int, dim: int, hidden: int, layers: int, out: int):
            super().__init__()
            self.embed = torch.nn.Sequential(torch.nn.Linear(features, dim), torch.nn.LayerNorm(dim))
            self.blocks = torch.nn.ModuleList(Block(dim, hidden) for _ in range(layers))
            self.norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, out))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    model = PartlyFrozen(**{k: v for k, v in sizes.items() if k != "frozen"})
    for name in sizes.get("frozen", ()):
        model.get_submodule(name).requires_grad_(False)
    return model


def toy_from_weights(sizes: dict, weights: dict) -> torch.nn.Module:
    """course_lib.models.ToyModel(**sizes) holding copies of `weights` (a state dict)."""
    from ....models import ToyModel

    model = ToyModel(**sizes)
    model.load_state_dict(weights)
    return model


def _full_params(fsdp_model) -> dict:
    """{name: parameter}, the whole of each, gathered (summon_full_params all-gathers every unit's shards)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ....measure.sharding import clean_name

    with FSDP.summon_full_params(fsdp_model, writeback=False):
        return {clean_name(n): p.detach().cpu().clone() for n, p in fsdp_model.named_parameters()}


def _sgd(fsdp_model, steps: list, lr: float) -> None:
    optimizer = torch.optim.SGD(fsdp_model.parameters(), lr=lr)
    device = rank_device()
    for inputs, targets in steps:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(fsdp_model(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()


def _unit_being_built(tb, names: dict) -> str | None:
    """The name (in the plain model) of the module FSDP was wrapping when it raised: the innermost
    FullyShardedDataParallel.__init__ frame's `module`; None if there is none."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    found = None
    while tb is not None:
        local = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_name == "__init__" and isinstance(local.get("self"), FSDP):
            found = names.get(id(local.get("module")), found)
        tb = tb.tb_next
    return found


def _mixed_unit(exc: Exception, model: torch.nn.Module, names: dict) -> Exception | None:
    """A clearer error for FSDP1's refusal of a unit holding frozen and trainable parameters (torch's words
    name neither the unit nor the parameters); None if `exc` is not that refusal."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if "uniform `requires_grad`" not in str(exc):
        return None
    name = _unit_being_built(exc.__traceback__, names)
    if name is None:
        return None
    module = model.get_submodule(name) if name else model

    def left(prefix, m):  # the parameters no unit below holds (a wrapped child is an FSDP instance by now)
        for n, p in m.named_parameters(prefix=prefix, recurse=False):
            yield n, p
        for child_name, child in m.named_children():
            if not isinstance(child, FSDP):
                yield from left(f"{prefix}.{child_name}" if prefix else child_name, child)

    held = list(left(name, module))
    frozen = [n for n, p in held if not p.requires_grad]
    trainable = [n for n, p in held if p.requires_grad]
    unit = f"the unit {name}" if name else "the root's unit"
    return ValueError(
        f"{str(exc).splitlines()[0]}: {unit} would hold frozen {', '.join(frozen[:3])} and trainable "
        f"{', '.join(trainable[:3])} in one FlatParameter, which has one requires_grad; a frozen module needs a "
        "unit of its own (FSDP asks about it before its parent)")


def fsdp_wrap_policy(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
                     lr: float) -> dict:
    """FSDP(wrap_model(sizes), auto_wrap_policy=fn), then one SGD(lr) step on this rank's shard of the batch.
    Send back the names of the modules that became FSDP units, how many parameters each holds (0: a unit of
    nothing) and the whole parameters after the step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ....measure.sharding import clean_name

    model = wrap_model(sizes)
    model.load_state_dict(weights)
    names = {id(m): name for name, m in model.named_modules()}

    def policy(module, recurse, nonwrapped_numel):  # FSDP calls it with keywords: not the learner's names
        return fn(module, recurse, nonwrapped_numel)

    try:
        fsdp_model = _fsdp(model, auto_wrap_policy=policy)
    except ValueError as exc:
        explained = _mixed_unit(exc, model, names)
        if explained is None:
            raise
        raise explained from exc
    wrapped = [(clean_name(name), module) for name, module in fsdp_model.named_modules() if isinstance(module, FSDP)]
    units = [name for name, _ in wrapped]
    held = {name: 0 if module._handle is None else int(module._handle.flat_param._unpadded_unsharded_size.numel())
            for name, module in wrapped}
    _sgd(fsdp_model, [(inputs, targets)], lr)
    return {"units": units, "held": held, "params": _full_params(fsdp_model)}


def fsdp_flat_shard(fn: Callable, shapes: list) -> dict:
    """FSDP(use_orig_params=True) over one module holding parameters of `shapes` (one unit, one FlatParameter);
    send back fn(numels, world_size) and what this rank's shard really holds (measure.sharding reads it): its
    numel, the padding torch appended to it, and the padding inside the unsharded FlatParameter (alignment, and
    the world-size padding that use_orig_params=True puts there)."""
    import math

    import torch.distributed as dist

    from ....measure.sharding import sharding_of

    module = torch.nn.Module()
    for index, shape in enumerate(shapes):
        module.register_parameter(f"p{index}", torch.nn.Parameter(torch.zeros(shape)))
    flat = sharding_of(_fsdp(module, use_orig_params=True))["flat"][0]
    returned = fn([math.prod(shape) for shape in shapes], dist.get_world_size())
    if isinstance(returned, (list, tuple)) and len(returned) == 2 and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in returned):
        answer = [int(x) for x in returned]
    else:
        answer = describe(returned) + (f" of {len(returned)}" if isinstance(returned, (list, tuple)) else "")
    return {"answer": answer, "shard_numel": flat["shard_numel"], "padding": flat["padding"],
            "inside": sum(end - start for name, start, end in flat["layout"] if name is None),
            "unsharded_numel": flat["unsharded_numel"]}


def _flat_units(fsdp_model) -> list:
    """One dict per FlatParameter this rank holds: measure.sharding's layout and the flat gradient's shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ....measure.sharding import sharding_of

    flats = sharding_of(fsdp_model)["flat"]
    handles = [m._handle for m in fsdp_model.modules() if isinstance(m, FSDP) and m._handle is not None]
    for flat, handle in zip(flats, handles):  # both in named_modules order
        grad = handle.flat_param.grad
        flat["grad"] = None if grad is None else grad.detach().cpu().clone()
    return flats


# What 04.clip_grad_norm asks the learner to build: refused while the learner's function runs.
_BUILT_HERE = (("torch.nn.utils", "clip_grad_norm_", "torch.nn.utils.clip_grad_norm_"),
               ("torch.nn.utils", "get_total_norm", "torch.nn.utils.get_total_norm"),
               ("torch.nn.utils", "clip_grads_with_norm_", "torch.nn.utils.clip_grads_with_norm_"),
               ("torch.distributed.fsdp", "FullyShardedDataParallel.clip_grad_norm_",
                "FullyShardedDataParallel.clip_grad_norm_"))


def fsdp_clip(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
              max_norm: float, lr: float) -> dict:
    """FSDP(ToyModel, one unit per Block) and one backward on this rank's shard of the batch; then
    fn(fsdp_model, max_norm), torch's and FSDP's clipping refused, then one SGD(lr) step. Send back what fn
    returned (a number), this rank's own shard norm before the call, every FlatParameter's gradient shard
    after it, and the whole parameters after the step."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ....models import Block

    fsdp_model = _fsdp(toy_from_weights(sizes, weights), auto_wrap_policy=ModuleWrapPolicy({Block}))
    device = rank_device()
    torch.nn.functional.mse_loss(fsdp_model(inputs.to(device)), targets.to(device)).backward()
    local = torch.stack([p.grad.double().square().sum() for p in fsdp_model.parameters()]).sum().sqrt()
    with refused(*_BUILT_HERE):
        returned = fn(fsdp_model, max_norm)
    if isinstance(returned, torch.Tensor) and returned.numel() == 1:
        norm = float(returned.item())
    elif isinstance(returned, (int, float)) and not isinstance(returned, bool):
        norm = float(returned)
    else:
        norm = describe(returned)
    flats = _flat_units(fsdp_model)
    torch.optim.SGD(fsdp_model.parameters(), lr=lr).step()
    return {"norm": norm, "local_norm": float(local), "flats": flats, "params": _full_params(fsdp_model)}


def _held_pieces(fsdp_model) -> dict:
    """{name: {"first": flat index, "values": ...}}: the piece of each original parameter this rank's FlatParameter
    shards hold (FlatParameter metadata; no collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ....measure.sharding import clean_name

    pieces = {}
    for prefix, module in fsdp_model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat, prefix = module._handle.flat_param, clean_name(prefix)
        for fqn, info in zip(flat._fqns, flat._shard_param_infos):
            if info.in_shard:
                start = info.offset_in_shard
                pieces[f"{prefix}.{fqn}" if prefix else fqn] = {
                    "first": int(info.intra_param_start_idx),
                    "values": flat.detach()[start:start + info.numel_in_shard].cpu().clone()}
    return pieces


# What 04.full_state_dict asks the learner to build: the distributed state dict's loaders, refused while it runs.
_LOADERS = tuple(("torch.distributed.checkpoint.state_dict", name, name) for name in
                 ("set_model_state_dict", "set_state_dict"))


def fsdp_load(fn: Callable, sizes: dict, weights: dict, policy: str, checkpoint: dict, file_name: str) -> dict:
    """ToyModel(sizes) holding `weights`, wrapped with one unit per Linear (`policy` "linears") or the root only
    ("root"); rank 0 alone finds `checkpoint` saved at its path (`file_name` in a folder of each rank's own: the
    others' paths hold no file, as on nodes with disks of their own); then fn(fsdp_model, path) on every rank.
    Send back the piece of each parameter this rank's shards hold afterwards."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrap = {"linears": {"auto_wrap_policy": ModuleWrapPolicy({torch.nn.Linear})}, "root": {}}[policy]
    fsdp_model = _fsdp(toy_from_weights(sizes, weights), **wrap)
    folder = os.path.join(os.getcwd(), f"rank{dist.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name)
    if dist.get_rank() == 0:
        torch.save(checkpoint, path)
    try:
        with refused(*_LOADERS):
            returned = fn(fsdp_model, path)
    except FileNotFoundError as exc:
        # torch's words name this run's temporary folder: the file's name is enough
        raise FileNotFoundError(
            f"no file {os.path.basename(path)} on rank {dist.get_rank()}: the file is on rank 0's disk only (each "
            "rank here has a folder of its own, as nodes have disks of their own); rank 0 reads it and sends each "
            "tensor") from exc
    return {"pieces": _held_pieces(fsdp_model), "returned": describe(returned)}


def _shapes_model(units: list) -> tuple:
    """(model, the submodules' class): a model whose root holds parameters of the shapes units[0] and whose `units` (a ModuleList) hold one
    submodule per other entry; forward runs every submodule, then the root's own parameters, so each gets a
    gradient. (batch, features) -> (batch, features)."""

    class Unit(torch.nn.Module):
        def __init__(self, shapes: list):
            super().__init__()
            for index, shape in enumerate(shapes):
                self.register_parameter(f"p{index}", torch.nn.Parameter(torch.randn(shape)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + 1e-3 * sum(p.square().sum() for p in self._parameters.values()))

    class Shapes(Unit):
        def __init__(self, units: list):
            super().__init__(units[0])
            self.units = torch.nn.ModuleList(Unit(shapes) for shapes in units[1:])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for unit in self.units:
                x = unit(x)
            return super().forward(x)

    return Shapes(units), Unit


def fsdp_memory(fn: Callable, units: list, strategy: str, optimizer: str) -> dict:
    """FSDP(a model of `units`' shapes, one unit per submodule, sharding_strategy=`strategy`) and one step of
    `optimizer` under measure_step; send back fn(units, strategy, world_size, optimizer) and the bytes of
    parameters, gradients and optimizer state this rank measured after the step."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ....measure.memory import measure_step

    torch.manual_seed(0)
    model, unit_type = _shapes_model([[tuple(shape) for shape in shapes] for shapes in units])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*NO_SHARD.*deprecated")  # FSDP1's advice to use DDP instead
        fsdp_model = _fsdp(model, auto_wrap_policy=ModuleWrapPolicy({unit_type}),
                           sharding_strategy=ShardingStrategy[strategy])
    build = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
             "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1)}[optimizer]
    returned = fn([[tuple(shape) for shape in shapes] for shapes in units], strategy, dist.get_world_size(), optimizer)
    generator = torch.Generator().manual_seed(dist.get_rank())
    device = rank_device()
    batch = (torch.randn(2, 3, generator=generator).to(device), torch.randn(2, 3, generator=generator).to(device))
    measured = measure_step(fsdp_model, build(fsdp_model.parameters()), batch, torch.nn.functional.mse_loss,
                            strategy="fsdp1")["phases"]["step"]
    if isinstance(returned, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in returned.values()):
        answer = {str(k): int(v) for k, v in returned.items()}
    else:
        answer = describe(returned)
    return {"answer": answer, "measured": {k: int(measured[k]) for k in ("parameters", "gradients", "optimizer")}}
