"""The rank side of lesson 06: tensor parallelism: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules every driver
follows: copy the inputs, return plain data). Every model and batch lives on the default group's device
(the CPU under the checker's gloo) and everything sent back is moved to the CPU.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

import torch

from ...drivers import describe

__all__ = ["Attention", "attention_plan", "megatron_mlp", "mesh_2d", "mlp_from_weights", "toy_from_weights"]


def _device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mlp_from_weights(weights: dict) -> torch.nn.Sequential:
    """Linear(d, h) -> GELU -> Linear(h, d) holding `weights` (keys 0.* and 2.*): one process's MLP."""
    hidden, dim = weights["0.weight"].shape
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
    mlp.load_state_dict(weights)
    return mlp


class Attention(torch.nn.Module):
    """Multi-head self-attention over (batch, seq, dim): q, k, v and o projections, `n_heads` heads of
    `head_dim`, causal. `forward` splits q, k and v into `self.n_heads` heads."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = [p(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)]
        attended = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


def _grads(module: torch.nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        out[name] = (g.to_local() if isinstance(g, DTensor) else g).detach().cpu().clone() \
            if isinstance(g, torch.Tensor) else describe(g)
    return out


def megatron_mlp(fn: Callable, weights: dict, inputs: torch.Tensor) -> dict:
    """`fn` is the learner's TPMLP class: TPMLP(up, down) from the whole Linears (the same on every rank).
    Forward on `inputs` (requiring grad), backward of out.sum(). Send back its parameters' shapes, the
    output, the input's gradient, each parameter's gradient and when forward and backward ran (ledger)."""
    cls, device = inspect.unwrap(fn), _device()
    mlp = mlp_from_weights(weights).to(device)
    with fn.learner_code():
        module = cls(mlp[0], mlp[2])
        if not isinstance(module, torch.nn.Module):
            return {"returned": describe(module)}
        shapes = {name: list(p.shape) for name, p in module.named_parameters()}
        x = inputs.to(device).clone().requires_grad_()
        started = time.monotonic()
        out = module(x)
        forward = [started, time.monotonic()]
        out.sum().backward()
        backward = [forward[1], time.monotonic()]
    return {"params": shapes, "out": out.detach().cpu().clone(), "x.grad": describe(x.grad) if x.grad is None
            else x.grad.cpu().clone(), "grads": _grads(module), "forward": forward, "backward": backward}


def _counts(comm) -> dict:
    return {str(op).split(".")[-1]: int(n) for op, n in comm.get_comm_counts().items()}


def attention_plan(fn: Callable, dim: int, n_heads: int, weights: dict, inputs: torch.Tensor) -> dict:
    """Attention(dim, n_heads) holding `weights`; fn(attention, mesh) parallelizes it over a 1-D mesh of every
    rank. Forward (counted by CommDebugMode) and backward of out.sum(); send back every parameter's placements
    and local shape, the output, the input's gradient, each parameter's gradient (the whole tensor) and the
    heads the module computes per rank."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    warnings.filterwarnings("ignore", message="Full backward hook")
    device = _device()
    attention = Attention(dim, n_heads).to(device)
    attention.load_state_dict(weights)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    returned = fn(attention, mesh)
    params = {n: {"placements": [repr(x) for x in p.placements] if isinstance(p, DTensor) else None,
                  "local": list((p.to_local() if isinstance(p, DTensor) else p).shape)}
              for n, p in attention.named_parameters()}
    x = inputs.to(device).clone().requires_grad_()
    local = params["q.weight"]["local"][0]
    if params["q.weight"]["placements"] == ["Shard(dim=0)"] and local // attention.head_dim != attention.n_heads:
        # torch's own words ("shape ... is invalid for input of size ...") name neither the heads nor the rank.
        return {"returned": describe(returned), "params": params, "n_heads": attention.n_heads,
                "error": f"nothing: it was not run. This rank's q projection gives {local} output features, "
                         f"{local // attention.head_dim} heads of {attention.head_dim}, but the module still splits "
                         f"them into n_heads={attention.n_heads}, and its forward's view would fail"}
    try:
        with CommDebugMode() as comm:
            out = attention(x)
            forward = _counts(comm)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001 - a wrong plan fails inside torch: the placements say why
        return {"returned": describe(returned), "params": params, "n_heads": attention.n_heads,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu().clone()
             for n, p in attention.named_parameters() if p.grad is not None}
    return {"returned": describe(returned), "params": params, "out": out.detach().cpu().clone(),
            "x.grad": x.grad.cpu().clone() if x.grad is not None else None, "grads": grads,
            "forward": forward, "n_heads": attention.n_heads}


def toy_from_weights(sizes: dict, weights: dict) -> torch.nn.Module:
    from ....models import ToyModel

    model = ToyModel(**sizes)
    model.load_state_dict(weights)
    return model


def mesh_2d(fn: Callable, sizes: dict, weights: dict, inputs: torch.Tensor, targets: torch.Tensor, lr: float,
            tp_size: int, steps: int) -> dict:
    """fn(model, tp_size) parallelizes ToyModel(**sizes) holding `weights` over a 2-D mesh it builds and
    returns. The driver gives each rank the rows of `inputs` of its coordinate on the mesh's "dp" dim (one of
    dp_size equal parts) and runs `steps` SGD(lr) steps on F.mse_loss. Send back the mesh (shape, names,
    groups), every parameter's placements per mesh dim, when each step ran (ledger) and every parameter's
    whole value afterwards."""
    import logging

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device = _device()
    model = toy_from_weights(sizes, weights).to(device)
    mesh = fn(model, tp_size)
    if not isinstance(mesh, DeviceMesh):
        return {"returned": describe(mesh)}
    names = list(mesh.mesh_dim_names or ())
    described = {"shape": list(mesh.shape), "names": names,
                 "groups": [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)]}
    params = {n: {"placements": [repr(x) for x in p.placements] if isinstance(p, DTensor) else None,
                  "mesh_names": list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else None}
              for n, p in model.named_parameters()}
    if mesh.ndim != 2 or "dp" not in names:
        return {"mesh": described, "params": params}
    parts, index = mesh.size(names.index("dp")), mesh.get_local_rank("dp")
    rows = inputs.shape[0] // parts
    mine = slice(index * rows, (index + 1) * rows)
    x, y = inputs[mine].to(device), targets[mine].to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    spans = []
    for _ in range(steps):
        started = time.monotonic()
        optimizer.zero_grad()
        out = model(x)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        torch.nn.functional.mse_loss(out, y).backward()
        optimizer.step()
        spans.append([started, time.monotonic()])
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
             for n, p in model.named_parameters()}
    return {"mesh": described, "params": params, "steps": spans, "whole": whole}
