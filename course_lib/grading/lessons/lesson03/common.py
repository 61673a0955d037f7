"""What lesson 03's exercises share: the learning rates, one process's optimizer on whole batches, ZeRO's greedy partition, and labels for the judges' messages.

The model is lesson 02's Linear-ReLU-Linear (weights drawn in the checker's process from a fixed
seed) with `F.mse_loss`; its parameters are `NAMES` = 0.weight (24 values), 0.bias (6), 2.weight (12),
2.bias (2).
"""

from __future__ import annotations

from ..lesson02.exercises import ATOL, DDP_PRELOAD, NAMES, RTOL, _batch, _model, _weights
from ...spec import RunOutcome

__all__ = ["ADAM_LR", "ALL_REDUCE", "ATOL", "DDP_PRELOAD", "LR", "NAMES", "RTOL", "ZERO_PRELOAD", "counts_label",
           "greedy_owners", "optimizer_reference", "shard_cases", "state_bytes", "whole_batches"]

LR = 0.1  # SGD's learning rate in 03.join_uneven_training
ADAM_LR = 0.01  # Adam's in 03.zero_sharded_checkpoint and 03.zero1_by_hand
ALL_REDUCE = frozenset({"all_reduce"})
ZERO_PRELOAD = DDP_PRELOAD + ("torch.distributed.optim.zero_redundancy_optimizer",)
OPTIMIZERS = ("Adam", "SGD")  # the optimizer classes a case may name (torch.optim.<name>)


def counts_label(counts: list) -> str:
    return ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))


def greedy_owners(numels: list[int], world_size: int) -> list[int]:
    """owner[i] of each tensor: largest first (a stable sort), each to the rank holding the fewest
    elements so far, the lowest such rank on a tie (ZeroRedundancyOptimizer._partition_parameters)."""
    sizes, owner = [0] * world_size, [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owner[index] = rank
        sizes[rank] += numels[index]
    return owner


def shard_cases(n: int, specs: list[tuple]) -> list[dict[int, tuple]]:
    """One case per (weights seed, steps, rows per rank, batch seed, *extra): rank r gets its rows of each
    step's batch, as (weights, [(inputs, targets) per step], *extra)."""
    cases = []
    for weights_seed, steps, rows, batch_seed, *extra in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(steps * n * rows, batch_seed)
        case = {}
        for r in range(n):
            starts = [(k * n + r) * rows for k in range(steps)]
            case[r] = (weights, [(inputs[s:s + rows], targets[s:s + rows]) for s in starts], *extra)
        cases.append(case)
    return cases


def whole_batches(outcome: RunOutcome, case: int) -> list[tuple]:
    """Each step's whole batch: every rank's rows of it, in rank order."""
    import torch

    steps = len(outcome.inputs[case][0][1])
    shards = [outcome.inputs[case][r][1] for r in range(outcome.nproc)]
    return [(torch.cat([s[k][0] for s in shards]), torch.cat([s[k][1] for s in shards])) for k in range(steps)]


def optimizer_reference(weights: list, batches: list, name: str = "Adam", defaults: dict | None = None,
                        model=None, optimizer=None):
    """(model, optimizer): torch.optim.<name>(**defaults) after one step per (inputs, targets) of `batches`,
    one process. Pass `model` and `optimizer` to go on from them."""
    import torch

    model = _model(weights) if model is None else model
    if optimizer is None:
        optimizer = getattr(torch.optim, name)(model.parameters(), **(defaults or {"lr": ADAM_LR}))
    for inputs, targets in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return model, optimizer


def state_bytes(state: dict) -> int:
    """Bytes of the tensors in one parameter's optimizer state (Adam: exp_avg, exp_avg_sq and step)."""
    import torch

    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


assert greedy_owners([24, 6, 12, 2], 2) == [0, 1, 1, 1] and greedy_owners([24, 6, 12, 2], 3) == [0, 2, 1, 2]
