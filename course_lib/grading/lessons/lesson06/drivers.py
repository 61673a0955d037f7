"""The rank side of lesson 06: tensor parallelism by hand: how each exercise calls the learner's code.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules every driver
follows: copy the inputs, return plain data). Everything lives on the CPU (the checker's ranks run gloo) and
everything sent back is a CPU copy; a gradient that never arrived is sent back as None.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

import torch

from ...drivers import describe

__all__ = ["mlp_from_weights", "sp_mlp", "vocab_cross_entropy", "vocab_embedding"]


def mlp_from_weights(weights: dict) -> torch.nn.Sequential:
    """Linear(d, h) -> GELU -> Linear(h, d) holding `weights` (keys 0.* and 2.*): one process's MLP."""
    hidden, dim = weights["0.weight"].shape
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
    mlp.load_state_dict(weights)
    return mlp


def _grad(t: torch.Tensor | None):
    return None if t is None else t.detach().cpu().clone()


def _timed(fn: Callable, module_or_fn, *args, backward_of: Callable = lambda out: out.sum()):
    """Forward `module_or_fn(*args)` and backward of `backward_of(out)`, each between two clock readings (the
    ledger's entries are placed in one or the other by their start time)."""
    with fn.learner_code():
        started = time.monotonic()
        out = module_or_fn(*args)
        forward = [started, time.monotonic()]
        if isinstance(out, torch.Tensor) and out.requires_grad:
            backward_of(out).backward()
        backward = [forward[1], time.monotonic()]
    return out, forward, backward


def sp_mlp(fn: Callable, weights: dict, rows: torch.Tensor) -> dict:
    """`fn` is the learner's SPMLP class: SPMLP(up, down) from the whole Linears (the same on every rank), called
    on this rank's rows of the sequence (requiring grad), then backward of out.sum(). Send back its parameters'
    shapes, the output, the rows' gradient, each parameter's gradient and when forward and backward ran."""
    cls = inspect.unwrap(fn)
    mlp = mlp_from_weights(weights)
    with fn.learner_code():
        module = cls(mlp[0], mlp[2])
    if not isinstance(module, torch.nn.Module):
        return {"returned": describe(module)}
    x = rows.clone().requires_grad_()
    out, forward, backward = _timed(fn, module, x)
    if not isinstance(out, torch.Tensor):
        return {"returned": describe(out)}
    return {"params": {n: list(p.shape) for n, p in module.named_parameters()}, "out": out.detach().cpu().clone(),
            "x.grad": _grad(x.grad), "grads": {n: _grad(p.grad) for n, p in module.named_parameters()},
            "forward": forward, "backward": backward}


def vocab_embedding(fn: Callable, weight: torch.Tensor, tokens: torch.Tensor) -> dict:
    """`fn` is the learner's VocabEmbedding class: VocabEmbedding(embedding) from the whole nn.Embedding holding
    `weight`, called on `tokens` (the same on every rank), then backward of the sum of (out * a fixed ramp), so
    that every row's gradient differs. Send back its parameters' shapes, the output, each parameter's gradient
    and when forward and backward ran."""
    cls = inspect.unwrap(fn)
    embedding = torch.nn.Embedding(*weight.shape)
    with torch.no_grad():
        embedding.weight.copy_(weight)
    with fn.learner_code():
        module = cls(embedding)
    if not isinstance(module, torch.nn.Module):
        return {"returned": describe(module)}
    out, forward, backward = _timed(fn, module, tokens.clone(), backward_of=lambda out: (out * ramp(out)).sum())
    if not isinstance(out, torch.Tensor):
        return {"returned": describe(out)}
    return {"params": {n: list(p.shape) for n, p in module.named_parameters()}, "out": out.detach().cpu().clone(),
            "grads": {n: _grad(p.grad) for n, p in module.named_parameters()}, "forward": forward,
            "backward": backward}


def ramp(out: torch.Tensor) -> torch.Tensor:
    """0.01, 0.02, ... over `out`'s elements, in its shape: the weights of the sum whose gradient is checked."""
    return torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape) / 100


def vocab_cross_entropy(fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """fn(logits, targets): `logits` this rank's columns of the vocabulary (requiring grad), `targets` the whole
    targets (the same on every rank). Backward of the returned loss. Send back the loss, the logits' gradient
    and when forward and backward ran."""
    x = logits.clone().requires_grad_()
    loss, forward, backward = _timed(fn, inspect.unwrap(fn), x, targets.clone(), backward_of=lambda out: out)
    if not isinstance(loss, torch.Tensor):
        return {"returned": describe(loss)}
    return {"loss": loss.detach().cpu().clone(), "logits.grad": _grad(x.grad), "forward": forward,
            "backward": backward}
