"""10.dedup_dispatch: expert parallelism where a token is sent once to each rank holding one of its experts.

DeepSeek-V3 (arXiv 2412.19437) sends each token to at most M = 4 nodes (node-limited routing, section 2.1.2): a
token crosses the network once to each node it reaches (section 3.2.2), so its bytes are bounded by the nodes,
not by the experts it chose there. Here: the
E experts sharded over p ranks (E/p each, lesson 10's layout), each rank's tokens sent once to every rank that
holds at least one of their top-k experts; that rank runs each of its chosen experts on the one copy and sums
them, weighted by the router, before one row goes home. Judged on 2 and 4 ranks against one process over all
ranks' tokens: the output and the input's gradient (this rank's rows), the router's gradient (the ranks' shares
summed, as a data-parallel all-reduce would), the experts' gradients (this rank's experts), and from the ledger
the bytes of the forward's token rows: U rows out and U rows back, U this rank's (token, rank) pairs.
"""

from __future__ import annotations

import functools

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, EXPERTS, HIDDEN, K, RTOL, layer_out, make_layer, make_tokens, route

__all__ = ["DEDUP_DISPATCH", "one_process", "unique_pairs"]

# (tokens per rank by rank, favoured experts, skew, seed): a plain batch; one whose every pair goes to experts 0
# and 1, both on rank 0 (the other experts and ranks receive nothing, no rank sends anything to ranks 1..p-1);
# batches of different sizes, favouring experts 1 and 2 (one rank's pair on 2 ranks, two ranks' on 4).
CASES = ((lambda r: 16, (), 0.0, 10), (lambda r: 16, (0, 1), 8.0, 20), (lambda r: 6 + 5 * r, (1, 2), 1.5, 30))
SAID = ("16 tokens a rank", "every pair to experts 0 and 1, on rank 0", "6 + 5·rank tokens, most to experts 1 and 2")

HINTS = (
    "Reread lesson 10, section 3: the counts exchange, the dispatch and the combine with uneven split sizes, "
    "`AllToAll` (backward: the same exchange reversed), and what each rank's router gradient covers.",
    "dist.all_to_all_single(out, in, output_split_sizes=..., input_split_sizes=...), a torch.autograd.Function "
    "around it; Tensor.scatter or a boolean [tokens, ranks] mask, Tensor.nonzero, Tensor.index_add.",
    "Mark, for each token, the ranks holding one of its k experts (expert // (E / p)); list the (token, rank) "
    "pairs by rank, exchange how many rows go to each rank, and send each pair's row once. With each row send "
    "its router weights for that rank's experts (0 for the others), through the same autograd exchange, so the "
    "router's gradient flows back. On arrival run each local expert on the rows that chose it, times its "
    "weight, sum per row, and send the sums back the reverse way; at home add each back to its token, with no "
    "weight applied again.",
)


def _tokens(case: int, rank: int):
    sizes, favoured, by, seed = CASES[case]
    return make_tokens(sizes(rank), seed=seed + rank, favoured=favoured, by=by)


def _grad_out(case: int, rank: int):
    import torch

    return torch.randn(CASES[case][0](rank), HIDDEN, generator=torch.Generator().manual_seed(500 + 10 * case + rank))


@functools.cache
def one_process(case: int, p: int) -> dict:
    """One process over all p ranks' tokens: out, and the gradients of x, router, gate_up, down for
    (out * grad).sum(); `rows`: each rank's slice of the tokens."""
    import torch

    xs = [_tokens(case, r) for r in range(p)]
    leaves = {n: t.clone().requires_grad_() for n, t in make_layer().items()}
    x = torch.cat(xs).requires_grad_()
    _, weights, experts = route(x, leaves["router"], K)
    out = layer_out(x, leaves, weights, experts)
    (out * torch.cat([_grad_out(case, r) for r in range(p)])).sum().backward()
    starts = [sum(len(t) for t in xs[:r]) for r in range(p + 1)]
    return {"out": out.detach(), "x": x.grad, "weights": weights.detach(), "experts": experts,
            "rows": [slice(starts[r], starts[r + 1]) for r in range(p)],
            **{n: t.grad for n, t in leaves.items()}}


def unique_pairs(experts, p: int, to: int | None = None) -> int:
    """(token, rank) pairs of a batch routed to `experts` [T, k]: for each token, the distinct ranks holding one of
    its experts (with `to`: only the tokens that visit rank `to`)."""
    ranks = [set(row) for row in (experts // (EXPERTS // p)).tolist()]
    return sum(len(row) for row in ranks) if to is None else sum(to in row for row in ranks)


def _visits(p: int, case: int, rank: int) -> tuple[int, int, int, int]:
    """(rows this rank sends, rows it receives), deduplicated, then one per (token, expert) pair."""
    ref = one_process(case, p)
    mine = ref["experts"][ref["rows"][rank]]
    others = [ref["experts"][ref["rows"][j]] for j in range(p)]
    local = EXPERTS // p
    pairs_in = sum(int(((e // local) == rank).sum()) for e in others)
    return (unique_pairs(mine, p), sum(unique_pairs(e, p, to=rank) for e in others), mine.numel(), pairs_in)


def _cases(nproc: int) -> list[dict[int, tuple]]:
    local = EXPERTS // nproc
    layer = make_layer()
    return [{r: (_tokens(case, r), layer["router"], layer["gate_up"][r * local:(r + 1) * local],
                 layer["down"][r * local:(r + 1) * local], K, _grad_out(case, r),
                 f"case {case + 1} of {len(CASES)} ({nproc} ranks, {SAID[case]})") for r in range(nproc)}
            for case in range(len(CASES))]


def _where(outcome: RunOutcome, case: int, rank: int) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks, {SAID[case]})"


def _returned(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        if result.output["returned"]:
            return [f"{_where(outcome, case, rank)}: dedup_moe {result.output['returned']}; return out, "
                    "[tokens, hidden], computed from x, the router and the experts"]
    return []


def _out(outcome: RunOutcome) -> list[str]:
    import torch

    problems = _returned(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        ref = one_process(case, outcome.nproc)
        mine = ref["rows"][rank]
        wrong = first_difference(result.output["out"], ref["out"][mine], rtol=RTOL, atol=ATOL)
        if wrong:
            text = f"{_where(outcome, case, rank)}: out {wrong}"
            if torch.allclose(result.output["out"], _weighted_twice(case, rank, outcome.nproc), rtol=RTOL, atol=ATOL):
                text += (": that is each expert's output times its router weight twice, at the expert's rank and "
                         "again at home; apply it once")
            return [text]
    return []


def _weighted_twice(case: int, rank: int, p: int):
    """The output when each rank's weighted sum is multiplied again, at home, by the weights of that rank's
    experts: each token's share from a rank, times the sum of its weights there."""
    import torch

    ref = one_process(case, p)
    mine = ref["rows"][rank]
    x, weights, experts = _tokens(case, rank), ref["weights"][mine], ref["experts"][mine]
    out = torch.zeros_like(x)
    for r in range(p):
        there = (experts // (EXPERTS // p)) == r
        out += layer_out(x, make_layer(), weights * there, experts) * (weights * there).sum(1, keepdim=True)
    return out


def _gradient(name: str):
    def judge(outcome: RunOutcome) -> list[str]:
        problems = _returned(outcome)
        if problems:
            return problems
        local = EXPERTS // outcome.nproc
        if name == "router":
            for case in range(len(outcome.results)):
                by_rank = outcome.results[case]
                missing = [r for r in sorted(by_rank) if by_rank[r].output["router"] is None]
                if missing:
                    return [f"{_where(outcome, case, missing[0])}: no gradient reached the router: its weights' "
                            "path to the output is cut (detached, or sent without autograd)"]
                total = sum(by_rank[r].output["router"] for r in sorted(by_rank))
                wrong = first_difference(total, one_process(case, outcome.nproc)["router"], rtol=RTOL, atol=ATOL)
                if wrong:
                    return [f"case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks, {SAID[case]}): the "
                            f"router's gradient summed over ranks 0-{outcome.nproc - 1}: {wrong} (one process's)"]
            return []
        for case, rank, result in each_result(outcome):
            ref = one_process(case, outcome.nproc)
            for part in ((name,) if name == "x" else ("gate_up", "down")):
                want = ref[part][ref["rows"][rank]] if part == "x" else ref[part][rank * local:(rank + 1) * local]
                got = result.output[part]
                if got is None and part != "x" and not want.any():
                    continue                    # no row reached this rank's experts: a gradient of zero, or none
                wrong = first_difference(got, want, rtol=RTOL, atol=ATOL, what=f"{part} on rank {rank}")
                if wrong:
                    text = f"{_where(outcome, case, rank)}: {part}'s gradient {wrong}"
                    if name == "x" and _others_right(outcome):
                        text += (": the router's and the experts' gradients are right, so what is missing is the "
                                 "gradient that reaches x through the dispatched rows: the dispatch needs the "
                                 "reverse all-to-all in backward (an autograd Function)")
                    return [text]
        return []
    return judge


def _others_right(outcome: RunOutcome) -> bool:
    """Whether the router's and the experts' gradients pass their judges on every case."""
    return not _gradient("router")(outcome) and not _gradient("experts")(outcome)


def token_rows(ledger: list[dict], before: float) -> list[dict]:
    """The all_to_all_single calls started before `before` whose input is token rows: [rows, hidden] floats."""
    return [c for c in ledger if c["op"] == "all_to_all_single" and c["start"] < before
            and str(c.get("dtype", "")).startswith(("float", "bfloat")) and c["shapes"]
            and len(c["shapes"][0]) == 2 and c["shapes"][0][1] == HIDDEN]


def _bytes(outcome: RunOutcome) -> list[str]:
    problems = _returned(outcome)
    if problems:
        return problems
    for case, rank, result in each_result(outcome):
        sent, received, sent_pairs, received_pairs = _visits(outcome.nproc, case, rank)
        calls = token_rows(result.ledger, result.output["forward_end"])
        got = sum(c["bytes"] for c in calls)
        want = (sent + received) * HIDDEN * 4
        if got != want:
            text = (f"{_where(outcome, case, rank)}: the forward's all_to_all_single calls of token rows ([rows, "
                    f"{HIDDEN}] floats, {len(calls)} call{'' if len(calls) == 1 else 's'}) put in {got:,} bytes; "
                    f"expected ({sent} + {received}) x "
                    f"{HIDDEN} floats x 4 bytes = {want:,}: the dispatch sends each of this rank's tokens once to "
                    f"each rank holding one of its experts ({sent} rows), the combine one row back for each row "
                    f"received ({received})")
            if got == (sent_pairs + received_pairs) * HIDDEN * 4:
                text += (f": that is one row per (token, expert) pair ({sent_pairs} + {received_pairs}), as lesson "
                         "10's ep_moe sends; a token whose experts share a rank goes there once")
            elif len(calls) < 2:
                text += (f": only {len(calls)} call{'' if len(calls) == 1 else 's'} of [rows, {HIDDEN}] token rows "
                         "before the forward ended, where the dispatch and the combine make one each: if your "
                         "dispatch sends the rows in a wider tensor (the weights beside them), send the weights in a "
                         "tensor of their own")
            return [text]
    return []


def _items(nproc: int) -> tuple[Item, ...]:
    return (
        Item(f"out equals one process's, on every case ({nproc} ranks)", 1, _out),
        Item(f"the input's gradient equals one process's ({nproc} ranks)", 1, _gradient("x")),
        Item(f"the router's gradient, summed over the ranks, equals one process's ({nproc} ranks)", 1,
             _gradient("router")),
        Item(f"the experts' gradients equal one process's, on each expert's rank ({nproc} ranks)", 1,
             _gradient("experts")),
        Item(f"each token row sent once to each rank holding its experts, and once back: bytes from the ledger "
             f"({nproc} ranks)", 1, _bytes),
    )


DEDUP_DISPATCH = Exercise(
    id="10.dedup_dispatch",
    function="dedup_moe",
    signature="dedup_moe(x, router, gate_up, down, k, route, expert_mlp) -> out",
    driver="dedup",
    hints=HINTS,
    allowed_ops=frozenset(("all_to_all_single",)),
    required_ops=frozenset(("all_to_all_single",)),
    # The driver's out.backward(grad) imports this (and sympy) on a rank's first call: ~1-2 s on every rank a
    # failed run restarted, unless the rank server has it before it forks.
    preload=("torch.fx.experimental.symbolic_shapes",),
    runs=(
        RunSpec(2, _cases, _items(2), timeout_s=20),
        RunSpec(4, _cases, _items(4), timeout_s=30),
    ),
)
