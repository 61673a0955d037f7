"""What lesson 08's exercises share: one process's reference of the exercises' pipeline, cases' labels, and the
gradient comparison.

The reference is the whole `drivers.make_model` in one process, the loss `mse_loss` over the whole batch: with
equal microbatches that is the mean of the microbatches' losses, what a pipeline step must produce.
"""

from __future__ import annotations

import functools

from ...spec import RunOutcome
from .drivers import make_batch, make_model

__all__ = ["RTOL", "grad_wrong", "one_process", "where"]

RTOL = 1e-5  # normwise: |got - want| <= RTOL * |want| over a whole gradient (some of its elements are tiny)


@functools.cache
def one_process(stages: int, rows: int, seed: int) -> tuple[float, dict[int, dict]]:
    """One process's loss and, per stage, {parameter name within the stage: gradient}."""
    import torch.nn.functional as F

    model = make_model(stages, seed)
    x, y = make_batch(stages, rows, seed)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    grads = {s: {n: p.grad.detach().clone() for n, p in model[s].named_parameters()} for s in range(stages)}
    return loss.item(), grads


def where(outcome: RunOutcome, case: int, rank: int, m: int) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks, {m} microbatches)"


def grad_wrong(got, want) -> str:
    """"" if `got` equals `want` normwise (RTOL); else how it differs, in words."""
    import torch

    if got is None:
        return "is None: no backward reached it"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"has shape {list(getattr(got, 'shape', []))}, expected {list(want.shape)}"
    error = (got - want).norm().item()
    if error <= RTOL * want.norm().item():
        return ""
    return f"differs from one process's by {error / max(want.norm().item(), 1e-30):.3g} of its norm"
