"""Lesson 04's shared grading pieces: tolerances, FSDP1's collectives, the toy model's weights and batches,
one process's SGD, and the comparison of parameter dicts (used by every module of this package)."""

from __future__ import annotations

from ...compare import first_difference

__all__ = ["ATOL", "FSDP1_OPS", "FSDP_PRELOAD", "LR", "RTOL", "TOY", "compare_params", "draw_batch", "draw_weights",
           "sgd_reference", "toy"]

RTOL, ATOL = 1e-5, 1e-6  # float32 results that differ from one process only by the order of additions
LR = 0.1  # SGD's learning rate
# FSDP1's collectives: on CPU (torch 2.13, 2.15) it all-gathers with the list form and reduce-scatters
# with reduce_scatter_single; on a GPU and older torch, the flat forms' other spellings.
FSDP1_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                       "reduce_scatter_single"})
FSDP_PRELOAD = ("torch.distributed.fsdp",)  # about 0.8 s a process, 130 modules
TOY = {"dim": 8, "hidden": 13, "layers": 2, "out": 5}  # course_lib.models.ToyModel's defaults: 503 parameters


def draw_batch(size: int, features: int, out: int, seed: int) -> tuple:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, features, generator=generator), torch.randn(size, out, generator=generator)


def draw_weights(build, seed: int) -> dict:
    """A state dict drawn as torch draws the model's parameters, from `seed`."""
    import torch

    torch.manual_seed(seed)
    return {name: value.detach().clone() for name, value in build().state_dict().items()}


def sgd_reference(model, steps: list, lr: float) -> dict:
    """{name: parameter} after one SGD(lr) step on mse_loss per (inputs, targets) of `steps`: one process."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for inputs, targets in steps:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def compare_params(got: dict, expected: dict, where: str) -> str:
    """The first parameter of `got` that differs from `expected` (or is missing), in words ("" if none)."""
    for name, want in expected.items():
        if name not in got:
            return f"{where}: no parameter {name} (got {', '.join(sorted(got)) or 'none'})"
        wrong = first_difference(got[name], want, rtol=RTOL, atol=ATOL)
        if wrong:
            return f"{where}: {name} {wrong}"
    return ""


def toy(weights: dict):
    from .drivers import toy_from_weights

    return toy_from_weights(TOY, weights)

