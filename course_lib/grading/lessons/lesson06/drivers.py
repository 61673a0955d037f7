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

__all__ = ["LOSS_SCALE", "autograd_reached", "mlp_from_weights", "sp_mlp", "vocab_cross_entropy", "vocab_embedding"]


def mlp_from_weights(weights: dict) -> torch.nn.Sequential:
    """Linear(d, h) -> GELU -> Linear(h, d) holding `weights` (keys 0.* and 2.*): one process's MLP."""
    hidden, dim = weights["0.weight"].shape
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
    mlp.load_state_dict(weights)
    return mlp


def _grad(t: torch.Tensor | None):
    return None if t is None else t.detach().cpu().clone()


def autograd_reached(out, leaf: torch.Tensor, module: str) -> str | None:
    """Whether `leaf`'s gradient is computed by the learner's own backward: None if, in the graph behind `out`,
    every node that hands `leaf` its gradient is the backward of an autograd.Function defined in the learner's
    module `module`; else the first other node that does (e.g. "EmbeddingBackward0": autograd differentiated the
    learner's code itself), or "not an input" if no node hands it anything (it never went into a Function)."""
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return None                                      # no graph at all: the gradient check says None
    own, seen, stack = False, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if getattr(child, "variable", None) is leaf:  # `node` computes the leaf's gradient
                if isinstance(node, torch.autograd.function.BackwardCFunction) and \
                        getattr(node._forward_cls, "__module__", None) == module:
                    own = True
                else:
                    return type(node).__name__
            stack.append(child)
    return None if own else "not an input"


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
    weight = dict(module.named_parameters()).get("weight")
    return {"params": {n: list(p.shape) for n, p in module.named_parameters()}, "out": out.detach().cpu().clone(),
            "grads": {n: _grad(p.grad) for n, p in module.named_parameters()}, "forward": forward,
            "backward": backward,
            "autograd": None if weight is None else autograd_reached(out, weight, cls.__module__)}


def ramp(out: torch.Tensor) -> torch.Tensor:
    """0.01, 0.02, ... over `out`'s elements, in its shape: the weights of the sum whose gradient is checked."""
    return torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape) / 100


LOSS_SCALE = 0.75  # the incoming gradient of the learner's loss: a backward that ignores it is off by this
# factor, which is neither a rank count nor the row count (the other factors the judge names)


def vocab_cross_entropy(fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """fn(logits, targets): `logits` this rank's columns of the vocabulary (requiring grad), `targets` the whole
    targets (the same on every rank). Backward of LOSS_SCALE * the returned loss (a scaled loss, as loss scaling
    or a weighted sum of losses makes: the backward must multiply by its incoming gradient). Send back the loss,
    the logits' gradient, whether that gradient came from the learner's Function and when forward and backward
    ran."""
    x = logits.clone().requires_grad_()
    inner = inspect.unwrap(fn)
    loss, forward, backward = _timed(fn, inner, x, targets.clone(), backward_of=lambda out: LOSS_SCALE * out)
    if not isinstance(loss, torch.Tensor):
        return {"returned": describe(loss)}
    return {"loss": loss.detach().cpu().clone(), "logits.grad": _grad(x.grad), "forward": forward,
            "backward": backward, "autograd": autograd_reached(loss, x, inner.__module__)}
