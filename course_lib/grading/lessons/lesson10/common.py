"""What lesson 10's exercises share: the layer (lesson 10's router and experts, in one [E, ...] tensor each),
the batches, the router and expert functions handed to the learner, one process's layer, and labels.

The layer is lesson 10's (`make_moe`, `route`, `expert_mlp` of its section 2), smaller in hidden size: E = 8
experts, top-2, hidden 6, experts 16 wide, float32, seeded. Hidden is 6, not the lesson's 8, so that a
[rows, hidden] tensor of token rows cannot be mistaken for a [rows, E] one (10.dedup_dispatch reads the token
rows' bytes from the ledger by their shape).
"""

from __future__ import annotations

import functools
import math

__all__ = ["ATOL", "EXPERTS", "HIDDEN", "INTER", "K", "RTOL", "expert_mlp", "layer_out", "make_layer", "make_tokens",
           "route"]

HIDDEN, INTER, EXPERTS, K = 6, 16, 8, 2
RTOL, ATOL = 1e-5, 1e-5  # float32 sums over at most 64 pairs, in another order than one process's


@functools.cache
def make_layer(seed: int = 0) -> dict:
    """Router [E, hidden]; gate_up [E, 2 * inter, hidden] (gate and up stacked); down [E, hidden, inter]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(EXPERTS, HIDDEN, generator=g),
            "gate_up": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / math.sqrt(HIDDEN),
            "down": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / math.sqrt(INTER)}


def make_tokens(n: int, seed: int, favoured: tuple = (), by: float = 0.0):
    """n seeded tokens [n, hidden]; with `favoured`, moved along the direction that raises those experts' logits
    by `by` and lowers the others' (lesson 10's `skew`): a batch the router sends mostly to them."""
    import torch

    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))
    if favoured:
        router = make_layer()["router"]
        target = torch.full((EXPERTS,), -float(by))
        target[list(favoured)] = by
        x = x + torch.linalg.pinv(router) @ target
    return x


def route(x, router, k):
    """Lesson 10's (Mixtral's) router: softmax over the E logits x @ router^T, the top k per token, their weights
    renormalised to sum to 1. Returns probs [T, E], weights [T, k], experts [T, k] (best first)."""
    import torch

    probs = torch.softmax(x @ router.T, dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return probs, weights / weights.sum(-1, keepdim=True), experts


def expert_mlp(rows, gate_up, down):
    """One expert on its rows [n, hidden]: down(silu(gate x) * up x), lesson 10's (Mixtral's) expert MLP."""
    import torch.nn.functional as F

    gate, up = (rows @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def layer_out(x, params: dict, weights, experts):
    """One process's layer: each (token, slot) pair's expert on the token, times `weights` [T, k], summed per
    token (a pair of weight 0 adds nothing)."""
    out = x.new_zeros(x.shape)
    for e in range(params["router"].shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if len(token):
            rows = expert_mlp(x[token], params["gate_up"][e], params["down"][e])
            out = out.index_add(0, token, rows * weights[token, slot][:, None])
    return out
