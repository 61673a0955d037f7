"""10.priority_capacity: capacity-limited routing in V-MoE's batch prioritized order, on each rank's own tokens.

Riquelme et al. 2021 ("Scaling Vision with Sparse Mixture of Experts", arXiv 2106.05974), Batch Prioritized
Routing, in the order google-research/vmoe implements (`vmoe/moe.py`, `get_top_experts_per_item_dispatcher` with
`batch_priority=True`; vmoe also rounds C up to a multiple of 4 by default and weights by the gates over all E,
here C and the weights are lesson 10's): every first choice before any second choice, as in lesson 10's position
order, but within each slot the tokens taken in decreasing order of their largest router probability instead of
their position. Each expert keeps the first C pairs of that queue, C = ceil(factor * T * k / E). Each rank's batch
is its own group (as the lesson's capacity section): no communication. Judged per rank against one process: which pairs
were kept (on factors where factor * T * k / E is an integer, then where it is not), and the output given the
pairs the rank kept (kept pairs weighted by their router weights as they are, dropped pairs adding nothing).
"""

from __future__ import annotations

import math

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, EXPERTS, K, RTOL, layer_out, make_layer, make_tokens, route

__all__ = ["PRIORITY_CAPACITY", "capacity_of", "kept_pairs"]

# (tokens, factor, favoured experts, skew): factor * T * k / E = 4.0, 5.0 (integers), 4.4, 3.6 (not).
CASES = ((16, 1.0, (), 0.0), (16, 1.25, (0, 1), 2.0), (16, 1.1, (), 0.0), (16, 0.9, (0,), 1.5))

HINTS = (
    "Reread lesson 10, section 4 (capacity: C = ceil(factor · tokens · k / E), every first choice before any "
    "second choice, a dropped pair adding nothing) and the lesson's `queue_positions`, which numbers the queue in "
    "position order.",
    "Tensor.max(dim) for each token's largest probability, torch.argsort(..., descending=True, stable=True), "
    "torch.nn.functional.one_hot and Tensor.cumsum for a place in a queue, math.ceil; Tensor.index_add_ for the "
    "output.",
    "Order the tokens by their largest router probability, highest first (ties: position order). Walk the pairs "
    "slot by slot, the first choices of all tokens in that order, then the second choices in the same order; "
    "number each pair within its expert's queue and keep it if its number is below C. Map the answer back to "
    "the tokens' own order. The output is the layer with each dropped pair's weight set to 0, the kept weights "
    "left as the router gave them.",
)


def capacity_of(factor: float, tokens: int, k: int, experts: int = EXPERTS, rounding=math.ceil) -> int:
    """Switch's capacity, ceil(factor * tokens * k / E) pairs per expert (`rounding` to try other rules)."""
    return int(rounding(factor * tokens * k / experts))


def kept_pairs(probs, experts, capacity: int, order: str = "priority"):
    """[T, k] bool: the pairs each expert keeps, its first `capacity` in the queue of slot 0's pairs then slot 1's,
    the tokens of each slot taken by `order`: "priority" (largest probability first, V-MoE's), "lowest" (smallest
    first), "renormalised" (largest of route's renormalised top-k weights first) or "position" (lesson 10's);
    "weight" ("probability"): each expert's `capacity` pairs of highest weight (router probability), not V-MoE's."""
    import torch
    import torch.nn.functional as F

    T, k = experts.shape
    if order in ("weight", "probability"):
        weights = probs.gather(1, experts)
        if order == "weight":                               # route's weights, renormalised over the k
            weights = weights / weights.sum(-1, keepdim=True)
        kept = torch.zeros(T, k, dtype=torch.bool)
        for e in range(probs.shape[1]):
            token, slot = (experts == e).nonzero(as_tuple=True)
            best = weights[token, slot].argsort(descending=True, stable=True)[:capacity]
            kept[token[best], slot[best]] = True
        return kept
    top = probs.max(-1).values
    chosen = probs.gather(1, experts)
    renormalised = (chosen / chosen.sum(-1, keepdim=True))[:, 0]
    tokens = {"priority": lambda: top.argsort(descending=True, stable=True),
              "lowest": lambda: top.argsort(stable=True),
              "renormalised": lambda: renormalised.argsort(descending=True, stable=True),
              "position": lambda: torch.arange(T)}[order]()
    queue = experts[tokens].T.flatten()                     # slot 0 of the ordered tokens, then slot 1
    place = (F.one_hot(queue, probs.shape[1]).cumsum(0) - 1).gather(1, queue[:, None])[:, 0]
    kept = torch.zeros(T, k, dtype=torch.bool)
    kept[tokens] = (place < capacity).view(k, T).T
    return kept


def case_tensors(case: int, rank: int):
    """(x, probs, weights, experts, C) of one case on one rank: its seeded tokens routed by the layer."""
    tokens, factor, favoured, by = CASES[case]
    x = make_tokens(tokens, seed=100 * case + rank, favoured=favoured, by=by)
    probs, weights, experts = route(x, make_layer()["router"], K)
    return x, probs, weights, experts, capacity_of(factor, tokens, K)


def _cases(nproc: int) -> list[dict[int, tuple]]:
    return [{r: (case_tensors(case, r)[0], dict(make_layer()), K, CASES[case][1]) for r in range(nproc)}
            for case in range(len(CASES))]


def _where(outcome: RunOutcome, case: int, rank: int) -> str:
    tokens, factor, *_ = CASES[case]
    return (f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({tokens} tokens, factor {factor:g}, "
            f"C = ceil({factor:g} · {tokens} · {K} / {EXPERTS}) = {capacity_of(factor, tokens, K)})")


def _returned(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        if result.output["returned"]:
            return [f"{_where(outcome, case, rank)}: priority_moe {result.output['returned']}; return (out, kept): "
                    f"out [tokens, hidden], kept a [tokens, {K}] bool tensor"]
    return []


def _named(kept, probs, experts, tokens: int, factor: float) -> str:
    """Which plausible rule `kept` follows, if it is one of them, in words (a leading ": "), else ""."""
    import torch

    C = capacity_of(factor, tokens, K)
    rules = (
        ("position", C, "lesson 10's position order: within a slot, take the tokens by their largest router "
                        "probability, highest first"),
        ("lowest", C, "the tokens with the smallest largest-probability first: take the highest first"),
        ("renormalised", C, "the tokens ranked by route's renormalised top weight; rank them by their largest "
                            "router probability (probs), as V-MoE does"),
        *((order, C, "each expert's highest-weight pairs, second choices competing with first choices: V-MoE "
                     "takes every first choice before any second choice") for order in ("weight", "probability")),
        ("priority", capacity_of(factor, tokens, K, rounding=math.floor),
         f"the capacity rounded down ({capacity_of(factor, tokens, K, rounding=math.floor)}): C = ceil(factor · "
         f"tokens · k / E)"),
        ("priority", capacity_of(factor, tokens, 1), f"the capacity without k ({capacity_of(factor, tokens, 1)}): "
                                                     "C = ceil(factor · tokens · k / E) counts pairs, k per token"),
    )
    for order, capacity, said in rules:
        if torch.equal(kept, kept_pairs(probs, experts, capacity, order)):
            return f": that is {said}"
    return ""


def _as_kept(value):
    """The learner's kept as a [T, k] bool tensor, or None if it cannot be one."""
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    if value.dtype != torch.bool:
        if not ((value == 0) | (value == 1)).all():
            return None
        value = value != 0
    return value


def _kept(integer: bool):
    def judge(outcome: RunOutcome) -> list[str]:
        problems = _returned(outcome)
        if problems:
            return problems
        for case, rank, result in each_result(outcome):
            tokens, factor, *_ = CASES[case]
            if (factor * tokens * K / EXPERTS == int(factor * tokens * K / EXPERTS)) != integer:
                continue
            x, probs, weights, experts, C = case_tensors(case, rank)
            want = kept_pairs(probs, experts, C)
            got = _as_kept(result.output["kept"])
            said = _where(outcome, case, rank)
            if got is None or got.shape != want.shape:
                return [f"{said}: kept is not a [{tokens}, {K}] tensor of booleans (True: the pair was kept)"]
            if not bool((got == want).all()):
                per_expert = [int(n) for n in (got.flatten().long() @ _one_hot(experts)).tolist()]
                token, slot = (got != want).nonzero()[0].tolist()
                did = "kept" if got[token, slot] else "dropped"
                text = (f"{said}: you {did} token {token}'s choice {slot + 1} (expert {int(experts[token, slot])}); "
                        f"batch prioritized routing {'drops' if did == 'kept' else 'keeps'} it. Pairs kept per "
                        f"expert: {per_expert}")
                return [text + _named(got, probs, experts, tokens, factor)]
        return []
    return judge


def _one_hot(experts):
    import torch.nn.functional as F

    return F.one_hot(experts.flatten(), EXPERTS)


def _out(outcome: RunOutcome) -> list[str]:
    import torch

    problems = _returned(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        x, probs, weights, experts, C = case_tensors(case, rank)
        got_kept = _as_kept(result.output["kept"])
        kept = got_kept if got_kept is not None and got_kept.shape == experts.shape else kept_pairs(probs, experts, C)
        want = layer_out(x, make_layer(), weights * kept, experts)
        got = result.output["out"]
        said = _where(outcome, case, rank)
        if got.shape != want.shape:
            return [f"{said}: out has shape {list(got.shape)}, expected {list(want.shape)}"]
        if not got.is_floating_point():
            return [f"{said}: out is {got.dtype}; return the layer's output, floats like x"]
        got = got.to(want.dtype)        # the statement asks for values: an answer computed in float64 is judged by them
        close = torch.isclose(got, want, rtol=RTOL, atol=ATOL)
        if not close.all():
            token, col = (~close).nonzero()[0].tolist()
            text = (f"{said}: out of token {token}, column {col} is {got[token, col].item():.6g}; with the pairs you "
                    f"kept, one process has {want[token, col].item():.6g}")
            share = weights * kept
            renormalised = share / share.sum(-1, keepdim=True).clamp_min(1e-30)
            everything = layer_out(x, make_layer(), weights, experts)
            if torch.allclose(got, layer_out(x, make_layer(), renormalised, experts), rtol=RTOL, atol=ATOL):
                text += (": that is the kept weights renormalised to sum to 1; keep the router's weights as they "
                         "are (a dropped pair's share is lost: the residual carries the token)")
            elif torch.allclose(got, everything, rtol=RTOL, atol=ATOL):
                text += ": that is the layer with no pair dropped; a dropped pair adds nothing"
            return [text]
    return []


ITEMS = (
    Item("kept: each expert's first C pairs in batch prioritized order, factor · T · k / E an integer (2 ranks)", 1,
         _kept(True)),
    Item("kept: the same where factor · T · k / E is not an integer, C rounded up (2 ranks)", 1, _kept(False)),
    Item("out: the kept pairs at their router weights, dropped pairs adding nothing (2 ranks)", 1, _out),
)

PRIORITY_CAPACITY = Exercise(
    id="10.priority_capacity",
    function="priority_moe",
    signature="priority_moe(x, params, k, factor, route, expert_mlp) -> (out, kept)",
    driver="priority",
    hints=HINTS,
    runs=(RunSpec(2, _cases, ITEMS, timeout_s=15),),
)
