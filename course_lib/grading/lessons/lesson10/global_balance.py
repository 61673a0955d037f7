"""10.global_balance_loss: Switch's load-balancing loss over the global batch of all data-parallel ranks.

Each rank routes its own tokens with the same router; the loss E · sum_e f_e · P_e (lesson 10's `balance_loss`:
f_e the share of all ranks' (token, expert) pairs routed to e, P_e the mean router probability of e over all ranks'
tokens) must have one process's value over the concatenated batch on every rank, and each rank's router gradient,
summed over the ranks (what a data-parallel all-reduce adds up), must equal one process's. Judged on 2 and 4
ranks: the value on batches of equal size, then of different sizes (the global mean is not the mean of the ranks'
means), and the summed gradient, with the usual slips recognised (a rank's local loss, f or P local, the gradient
a factor off).
"""

from __future__ import annotations

import functools

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import EXPERTS, K, make_layer, make_tokens, route

__all__ = ["GLOBAL_BALANCE", "balance_loss", "one_process"]

RTOL, ATOL = 1e-5, 1e-6

# (tokens by rank, favoured expert by rank, skew): equal batches, plain and skewed towards expert 0 on every rank;
# batches of 8 + 12·rank tokens, rank r's skewed towards expert r (the ranks' P differ, and their sizes).
CASES = ((lambda r: 16, lambda r: (), 0.0), (lambda r: 16, lambda r: (0,), 2.0), (lambda r: 8 + 12 * r, lambda r: (r,), 2.0))
SAID = ("16 tokens a rank", "16 tokens a rank, most to expert 0", "8 + 12·rank tokens, rank r's mostly to expert r")

HINTS = (
    "Reread lesson 10, section 4, \"Balancing the load\": f_e counts pairs, P_e averages probabilities, the "
    "gradient flows through P only; and lesson 02 on what a data-parallel all-reduce adds up.",
    "torch.bincount(..., minlength=E), Tensor.sum(0), dist.all_reduce (in place, not differentiable: on a copy "
    "that is detached), Tensor.detach.",
    "All-reduce the counts per expert and the number of pairs: f. All-reduce the sum of the probabilities over "
    "tokens and the number of tokens: P's value. For the gradient, each rank's loss must depend on its own "
    "tokens' probabilities only, each divided by the global token count: P = (own sum + the others' sum as a "
    "constant) / all tokens.",
)


def balance_loss(probs, experts):
    """Switch's loss E · sum_e f_e · P_e over one batch (lesson 10's `balance_loss`)."""
    import torch

    f = torch.bincount(experts.flatten(), minlength=EXPERTS) / experts.numel()
    return EXPERTS * (f * probs.mean(0)).sum()


def _tokens(case: int, rank: int):
    sizes, favoured, by = CASES[case]
    return make_tokens(sizes(rank), seed=700 + 10 * case + rank, favoured=favoured(rank), by=by)


@functools.cache
def one_process(case: int, p: int) -> dict:
    """The loss over all p ranks' tokens and its router gradient; each rank's probs and experts (detached)."""
    import torch

    router = make_layer()["router"].clone().requires_grad_()
    xs = [_tokens(case, r) for r in range(p)]
    probs, _, experts = route(torch.cat(xs), router, K)
    loss = balance_loss(probs, experts)
    loss.backward()
    parts = [route(x, make_layer()["router"], K) for x in xs]
    return {"loss": loss.item(), "router": router.grad, "probs": [q for q, _, _ in parts],
            "experts": [e for _, _, e in parts]}


def _cases(nproc: int) -> list[dict[int, tuple]]:
    return [{r: (_tokens(case, r), make_layer()["router"], K) for r in range(nproc)} for case in range(len(CASES))]


def _where(outcome: RunOutcome, case: int, rank: int) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks, {SAID[case]})"


def _returned(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        if result.output["returned"]:
            return [f"{_where(outcome, case, rank)}: global_balance_loss {result.output['returned']}; return the "
                    "loss, a one-element tensor computed from probs"]
    return []


def _named_value(got: float, case: int, rank: int, p: int) -> str:
    """Which slip a wrong value is, if it is one of them (a leading ": "), else ""."""
    import torch

    ref = one_process(case, p)
    probs, experts = ref["probs"], ref["experts"]
    f = [torch.bincount(e.flatten(), minlength=EXPERTS) / e.numel() for e in experts]
    f_all = torch.bincount(torch.cat(experts).flatten(), minlength=EXPERTS) / sum(e.numel() for e in experts)
    P = [q.mean(0) for q in probs]
    P_all = torch.cat(probs).mean(0)
    candidates = (
        (EXPERTS * (f[rank] * P[rank]).sum(), "this rank's own loss, f and P from its tokens only"),
        (sum(EXPERTS * (f[r] * P[r]).sum() for r in range(p)) / p, "the mean of the ranks' own losses, not the "
                                                                   "loss of the global f and P"),
        (EXPERTS * (f_all * P[rank]).sum(), "f over all ranks but P from this rank's tokens only"),
        (EXPERTS * (f[rank] * P_all).sum(), "P over all ranks but f from this rank's pairs only"),
        (EXPERTS * (f_all * sum(P) / p).sum(), "P as the mean of the ranks' means: with batches of different "
                                               "sizes, divide the sum over all tokens by the number of all tokens"),
        (EXPERTS * (sum(f) / p * P_all).sum(), "f as the mean of the ranks' shares: with batches of different "
                                               "sizes, divide the counts over all ranks by all the pairs"),
    )
    for value, said in candidates:
        if abs(got - float(value)) <= RTOL * abs(float(value)) + ATOL:
            return f": that is {said}"
    return ""


def _value(equal: bool):
    def judge(outcome: RunOutcome) -> list[str]:
        problems = _returned(outcome)
        if problems:
            return problems
        for case, rank, result in each_result(outcome):
            if (case < 2) != equal:
                continue
            want = one_process(case, outcome.nproc)["loss"]
            got = result.output["loss"]
            if abs(got - want) > RTOL * abs(want) + ATOL:
                return [f"{_where(outcome, case, rank)}: the loss is {got:.6g}; one process's over all ranks' "
                        f"tokens is {want:.6g}" + _named_value(got, case, rank, outcome.nproc)]
        return []
    return judge


def _gradient(outcome: RunOutcome) -> list[str]:
    import torch

    problems = _returned(outcome)
    if problems:
        return problems
    p = outcome.nproc
    for case in range(len(outcome.results)):
        by_rank = outcome.results[case]
        missing = [r for r in sorted(by_rank) if by_rank[r].output["router"] is None]
        if missing:
            return [f"{_where(outcome, case, missing[0])}: no gradient reached the router: the loss does not "
                    "depend on this rank's probs through autograd"]
        total = sum(by_rank[r].output["router"] for r in sorted(by_rank))
        want = one_process(case, p)["router"]
        wrong = first_difference(total, want, rtol=RTOL, atol=ATOL)
        if wrong:
            text = (f"case {case + 1} of {len(outcome.inputs)} ({p} ranks, {SAID[case]}): the router's gradient "
                    f"summed over ranks 0-{p - 1}: {wrong} (one process's)")
            for factor, said in ((p, f"the world size, {p}: each rank's loss carries the gradient of every rank's "
                                     "tokens (an all-reduce in the graph whose backward sums again), or its own "
                                     "divided by its own token count"),
                                 (2, "2: this rank's probabilities reach the loss twice, once in its own sum and "
                                     "once in the all-reduced one"),
                                 (1 / p, f"1 / {p}: divide each rank's own sum by the number of all tokens, "
                                         "and sum (not average) over the ranks")):
                if torch.allclose(total, factor * want, rtol=RTOL, atol=ATOL):
                    text += f": that is one process's times {said}"
                    break
            return [text]
    return []


def _items(nproc: int) -> tuple[Item, ...]:
    return (
        Item(f"the loss equals one process's over all ranks' tokens, on every rank, batches of equal size "
             f"({nproc} ranks)", 1, _value(True)),
        Item(f"the same with batches of different sizes ({nproc} ranks)", 1, _value(False)),
        Item(f"the router's gradient, summed over the ranks, equals one process's ({nproc} ranks)", 1, _gradient),
    )


GLOBAL_BALANCE = Exercise(
    id="10.global_balance_loss",
    function="global_balance_loss",
    signature="global_balance_loss(probs, experts) -> loss",
    driver="global_balance",
    hints=HINTS,
    runs=(
        RunSpec(2, _cases, _items(2), timeout_s=15),
        RunSpec(4, _cases, _items(4), timeout_s=20),
    ),
)
