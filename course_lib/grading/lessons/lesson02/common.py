"""What lesson 02's exercises share: the small model, its weights and batches, one process's gradients,
and the hint for a result that is a multiple of the right one.

Every rank gets the same small MLP (weights drawn here, in the checker's process, from a fixed
seed; drivers.mlp_from_weights builds it) and its own shard of a batch. The reference is one
process on the whole batch, computed here without torch.distributed.
"""

from __future__ import annotations

import math

from ...spec import RunOutcome

# The underscored helpers are shared by this lesson's exercise modules and lesson 03's (not learners' API).
__all__ = ["ALL_REDUCE", "ATOL", "DDP_PRELOAD", "FEATURES", "FP16_ATOL", "FP16_RTOL", "HIDDEN", "LR", "NAMES", "OUT",
           "RTOL", "_batch", "_batch_label", "_full_batch", "_grads", "_model", "_ratio_hint", "_sgd_step",
           "_shard_cases", "_weights"]

# float32 results that differ from the reference only by the order of additions.
RTOL, ATOL = 1e-5, 1e-6
# float16 on the wire: 11 significant bits, a rounding of at most 2**-11 (about 4.9e-4) of a value
# per cast, division and addition. The solution is at most 1.8e-4 off in these cases (gradients of
# 4.5e-3 to 0.39); a missing division by N is off by (N-1) times the gradient.
FP16_RTOL, FP16_ATOL = 1e-2, 1e-3
LR = 0.1  # SGD's learning rate in 02.no_sync_accumulation
FEATURES, HIDDEN, OUT = 4, 6, 2  # the model: Linear(4, 6) -> ReLU -> Linear(6, 2)
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")
ALL_REDUCE = frozenset({"all_reduce"})
DDP_PRELOAD = ("torch._dynamo",)  # DistributedDataParallel's constructor imports it


def _weights(seed: int) -> list:
    """[0.weight, 0.bias, 2.weight, 2.bias], drawn as nn.Linear draws them (uniform within 1/sqrt(fan_in))."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = [((HIDDEN, FEATURES), FEATURES), ((HIDDEN,), FEATURES), ((OUT, HIDDEN), HIDDEN), ((OUT,), HIDDEN)]
    return [(torch.rand(shape, generator=generator) * 2 - 1) / math.sqrt(fan_in) for shape, fan_in in shapes]


def _batch(size: int, seed: int) -> tuple:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, FEATURES, generator=generator), torch.randn(size, OUT, generator=generator)


def _model(weights: list, frozen=(), tied=()):
    from .drivers import mlp_from_weights

    return mlp_from_weights(weights, frozen, tied)


def _grads(weights: list, inputs, targets, frozen=()) -> dict:
    """{name: gradient of mse_loss on (inputs, targets), None for a frozen parameter}: one process."""
    import torch

    model = _model(weights, frozen)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _ratio_hint(got, expected, n: int, rtol: float = 1e-3, atol: float = 1e-6) -> str:
    """Why `got` is a multiple of `expected` (within rtol, atol), if it is one the usual mistakes make ("" otherwise)."""
    import torch

    scale = float((got.double() * expected.double()).sum() / expected.double().square().sum().clamp_min(1e-30))
    if not torch.allclose(got.double(), scale * expected.double(), rtol=rtol, atol=atol):
        return ""
    if math.isclose(scale, n, rel_tol=1e-3):
        return f": that is {n} times the average, the sum; divide it by the world size (or use ReduceOp.AVG)"
    if math.isclose(scale, 1 / n, rel_tol=1e-3):
        return (f": that is the average divided by {n} again: the gradients were averaged twice; divide by the "
                "world size once, before or after the all-reduce")
    divisor = n / scale
    if abs(divisor - round(divisor)) < 1e-3 and round(divisor) not in (0, n):
        return f": that is the sum divided by {round(divisor)}; divide by the world size, {n} here"
    return ""


def _shard_cases(n: int, specs: list[tuple[int, int, int, tuple]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, batch size, batch seed, frozen names): rank r gets rows r*b/n.. of the batch."""
    cases = []
    for weights_seed, size, batch_seed, frozen in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(size, batch_seed)
        rows = size // n
        cases.append({r: (weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], list(frozen))
                      for r in range(n)})
    return cases


def _full_batch(outcome: RunOutcome, case: int) -> tuple:
    """The whole batch of a case: every rank's shard, in rank order."""
    import torch

    shards = [outcome.inputs[case][r] for r in range(outcome.nproc)]
    return torch.cat([s[1] for s in shards]), torch.cat([s[2] for s in shards])


def _batch_label(outcome: RunOutcome, case: int) -> str:
    inputs, _ = _full_batch(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} (batch of {inputs.shape[0]} split over "
            f"{outcome.nproc} ranks)")


def _sgd_step(weights: list, inputs, targets, lr: float) -> dict:
    """{name: parameter} after one SGD step on mse_loss of (inputs, targets): one process."""
    import torch

    model = _model(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}

