"""The rank side of lesson 10: mixture of experts and expert parallelism: how each exercise calls the learner's
function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules every driver
follows: copy the inputs, return plain data). Everything lives on the CPU (the checker's ranks run gloo); a
gradient that never arrived is sent back as None. The drivers that run a backward mark, on `time.monotonic()` (the
ledger's clock), when the forward ended, so that a judge can tell the forward's collectives from the backward's.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ...drivers import describe
from .common import expert_mlp, route

__all__ = ["dedup", "global_balance", "priority"]


def _tensor(value, name: str):
    """A returned tensor, detached, on the CPU; or None and what it was instead."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone(), ""
    return None, f"{name} is a {describe(value)}"


def _grad(t: torch.Tensor):
    return None if t.grad is None else t.grad.detach().cpu().clone()


def priority(fn: Callable, x, params: dict, k: int, factor: float) -> dict:
    """10.priority_capacity: the learner's (out, kept) on this rank's own tokens."""
    got = fn(x.clone(), {n: t.clone() for n, t in params.items()}, k, factor, route, expert_mlp)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return {"returned": f"returned a {describe(got)}, not a pair (out, kept)"}
    out, wrong_out = _tensor(got[0], "out")
    kept, wrong_kept = _tensor(got[1], "kept")
    return {"returned": wrong_out or wrong_kept, "out": out, "kept": kept}


def dedup(fn: Callable, x, router, gate_up, down, k: int, grad, where: str) -> dict:
    """10.dedup_dispatch: the learner's layer on this rank's tokens with this rank's experts, then backward of
    (out * grad).sum(); the output, the gradients of x, router (this rank's share), gate_up and down, and when
    the forward ended. `where`: the case, in words ("case 2 of 3 (2 ranks, ...)")."""
    leaves = [t.clone().requires_grad_() for t in (x, router, gate_up, down)]
    out = fn(*leaves, k, route, expert_mlp)
    forward_end = time.monotonic()
    if not isinstance(out, torch.Tensor):
        return {"returned": f"returned a {describe(out)}, not a tensor"}
    if out.shape != x.shape:
        return {"returned": f"returned a tensor of shape {list(out.shape)}, not {list(x.shape)}"}
    if out.grad_fn is None:
        # This rank cannot join the backward all-to-alls its peers may run; skipping backward here would let a
        # peer's backward message meet this rank's next case (gloo then fills the counts with its floats).
        raise RuntimeError(
            f"{where}: dedup_moe's out has no autograd graph on this rank (nothing in it depends, through "
            "autograd, on the rows it received or on x), so it cannot take part in the backward all-to-alls: "
            "keep what each rank receives in the graph, e.g. run each local expert even on zero rows, and send "
            "through an autograd Function")
    with fn.learner_code():                                 # the learner's autograd Functions run here
        out.backward(grad.clone())
    names = ("x", "router", "gate_up", "down")
    return {"returned": "", "out": out.detach().clone(), "forward_end": forward_end,
            **{name: _grad(leaf) for name, leaf in zip(names, leaves)}}


def global_balance(fn: Callable, x, router, k: int) -> dict:
    """10.global_balance_loss: this rank's tokens routed by a router leaf, the learner's loss of (probs, experts),
    then its backward; the loss's value and this rank's router gradient."""
    leaf = router.clone().requires_grad_()
    probs, _, experts = route(x.clone(), leaf, k)
    loss = fn(probs, experts.clone())
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {describe(loss)}"
        return {"returned": f"returned {what}, not a one-element tensor"}
    value = float(loss.detach())
    if loss.grad_fn is None:
        return {"returned": "", "loss": value, "router": None}
    with fn.learner_code():
        loss.reshape(()).backward()
    return {"returned": "", "loss": value, "router": _grad(leaf)}
