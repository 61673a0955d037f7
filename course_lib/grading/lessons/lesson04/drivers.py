"""The rank side of lesson 04: FullyShardedDataParallel (FSDP1): how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules
every driver follows: copy the inputs, return plain data).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...drivers import describe, rank_device, refused

__all__ = ['wrap_model', 'toy_from_weights', 'fsdp_wrap_policy', 'fsdp_flat_shard', 'fsdp_clip', 'fsdp_save', 'fsdp_memory']


def _fsdp(model: torch.nn.Module, **kwargs):
    """FSDP1 (FULL_SHARD, use_orig_params=False: its defaults) over the default group, on this rank's device."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=rank_device(), **kwargs)  # moves the model there; on a CPU FSDP1 needs it said


def wrap_model(sizes: dict) -> torch.nn.Module:
    """04.wrap_policy's model: stem (Linear(features, width) -> ReLU -> Linear(width, dim)), `layers` Blocks
    (course_lib.models.Block(dim, hidden)), head Linear(dim, out). (batch, features) -> (batch, out)."""
    from ....models import Block

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


def fsdp_wrap_policy(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor,
                     lr: float) -> dict:
    """FSDP(wrap_model(sizes), auto_wrap_policy=fn), then one SGD(lr) step on this rank's shard of the batch.
    Send back the names of the modules that became FSDP units and the whole parameters after the step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ....measure.sharding import clean_name

    model = wrap_model(sizes)
    model.load_state_dict(weights)

    def policy(module, recurse, nonwrapped_numel):  # FSDP calls it with keywords: not the learner's names
        return fn(module, recurse, nonwrapped_numel)

    fsdp_model = _fsdp(model, auto_wrap_policy=policy)
    units = [clean_name(name) for name, module in fsdp_model.named_modules() if isinstance(module, FSDP)]
    _sgd(fsdp_model, [(inputs, targets)], lr)
    return {"units": units, "params": _full_params(fsdp_model)}


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
        described["type"] = describe(state)
    return described


def fsdp_save(fn: Callable, sizes: dict, weights: dict, steps: list, lr: float, file_name: str) -> dict:
    """FSDP(ToyModel, one unit per Block) takes one SGD(lr) step per (inputs, targets) of `steps` (this
    rank's shard); then fn(fsdp_model, path), `path` being `file_name` in a folder of this rank's own.
    Send back what each rank finds at its path right after fn returns, and what each state_dict() call on the
    model gave this rank."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ....models import Block

    fsdp_model = _fsdp(toy_from_weights(sizes, weights), auto_wrap_policy=ModuleWrapPolicy({Block}))
    _sgd(fsdp_model, [tuple(pair) for pair in steps], lr)
    folder = os.path.join(os.getcwd(), f"rank{dist.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name)
    built = []  # what each state_dict() call gave this rank: its kind and how many entries
    plain_state_dict = fsdp_model.state_dict

    def state_dict(*args, **kwargs):
        state = plain_state_dict(*args, **kwargs)
        kind = getattr(fsdp_model, "_state_dict_type", None)
        built.append({"type": getattr(kind, "name", str(kind)), "entries": len(state)})
        return state

    fsdp_model.state_dict = state_dict  # an instance attribute: every model.state_dict() call passes here
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
    finally:
        del fsdp_model.state_dict
    return {"file": _describe_file(path), "returned": describe(returned), "built": built}


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
