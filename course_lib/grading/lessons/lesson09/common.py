"""What lesson 09's exercises share: the cases' q, k, v and positions, one process's attention, and labels.

One process's reference is full attention over the whole sequence (`F.scaled_dot_product_attention`, causal
or not) and its gradients by autograd; each rank is compared with that reference's rows at the positions the
rank holds. The split into ranks is the lesson's: the sequence cut into 2p equal chunks, rank r holding chunks
2r, 2r + 1 (contiguous) or r, 2p - 1 - r (zigzag).
"""

from __future__ import annotations

import functools
import math

from ...spec import RunOutcome

__all__ = ["ATOL", "RTOL", "Case", "case_inputs", "lse_of", "one_process", "positions_of", "where"]

RTOL, ATOL = 1e-5, 1e-5  # float32 attention over at most 64 keys: differences of a few 1e-7 between orders


@functools.cache
def positions_of(s: int, p: int, zigzag: bool) -> tuple:
    """The sequence positions each of p ranks holds, in its row order: p 1-D int64 tensors."""
    import torch

    n = s // (2 * p)
    chunks = [(r, 2 * p - 1 - r) if zigzag else (2 * r, 2 * r + 1) for r in range(p)]
    return tuple(torch.cat([torch.arange(c * n, (c + 1) * n) for c in pair]) for pair in chunks)


@functools.cache
def one_process(s: int, heads: int, dim: int, causal: bool, seed: int) -> dict:
    """Full attention in one process: q, k, v, the output's gradient, out, lse [1, heads, s], dq, dk, dv."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(1, heads, s, dim, generator=generator) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad)
    return {"q": q, "k": k, "v": v, "grad": grad, "out": out.detach(), "lse": lse_of(q, k, causal),
            "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def lse_of(q, k, causal: bool, flipped: bool = False):
    """Each query row's log-sum-exp of its scores, [1, heads, s]; `flipped`: the mask on the wrong side."""
    import torch

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        rows = torch.arange(q.shape[-2])
        later = rows[None, :] > rows[:, None]
        scores = scores.masked_fill(later.T if flipped else later, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


Case = tuple  # (s, heads, dim, causal, zigzag, seed)


def case_inputs(nproc: int, case: Case, names: tuple[str, ...]) -> dict[int, tuple]:
    """{rank: (the named tensors' rows this rank holds, ..., positions of every rank, causal)}."""
    s, heads, dim, causal, zigzag, seed = case
    ref = one_process(s, heads, dim, causal, seed)
    positions = positions_of(s, nproc, zigzag)
    return {r: (*(ref[name][..., positions[r], :] if ref[name].dim() == 4 else ref[name][..., positions[r]]
                  for name in names), list(positions), causal) for r in range(nproc)}


def where(outcome: RunOutcome, case: int, rank: int, cases: tuple) -> str:
    s, heads, dim, causal, zigzag, _ = cases[case]
    split = "zigzag" if zigzag else "contiguous"
    mask = "causal" if causal else "no mask"
    return (f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks, s = {s}, {mask}, "
            f"{split} split)")
