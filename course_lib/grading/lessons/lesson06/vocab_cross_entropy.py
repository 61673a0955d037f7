"""06.vocab_cross_entropy: the cross-entropy of vocabulary-sharded logits by hand (what loss_parallel does).

Each rank holds its columns of the logits; the loss needs the row's max (an all-reduce with MAX, no gradient),
the sum of exponentials (an all-reduce of each rank's partial sum) and the target's logit (masked on the
ranks that do not hold it, then an all-reduce); backward, written by hand in the learner's autograd Function, is
this rank's columns of (softmax - one-hot of the target) / rows, from what forward saved. Judged against one process's F.cross_entropy: the loss on every
rank, each rank's columns of the logits' gradient (of a scaled loss, so that a backward ignoring its incoming
gradient shows; computed by the learner's own backward: the graph from the loss to the logits runs through their
autograd.Function), with one case of large logits (exp overflows float32
without the max); from the ledger, three all-reduces in forward, each of at most one number per row (the whole
logits never exist on one rank), and none in backward. The usual mistakes are named: a local max, no max, a max
summed instead of MAX'd, the target not masked, the backward summing again or ignoring its incoming gradient,
no autograd.Function (autograd through in-place all-reduces), two quantities in one all-reduce, the whole logits
all-reduced.
"""

from __future__ import annotations

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, RTOL, flows, judge_each, not_returned, own_backward, where

__all__ = ["VOCAB_CROSS_ENTROPY"]

VOCAB, ROWS = 16, 6  # 8 columns per rank on 2 ranks, 4 on 4

HINTS = (
    "Reread lesson 06, section 4: what `loss_parallel` computes on `Shard(-1)` logits.",
    "dist.all_reduce with op=dist.ReduceOp.MAX and with the default sum; torch.gather, a boolean mask; "
    "ctx.save_for_backward, Tensor.scatter_add.",
    "loss = log(sum of exp(logit - max)) - (target's logit - max), averaged over rows. The max over the whole row "
    "is a constant shift (no gradient); each rank adds up exp over its own columns and the ranks' sums are "
    "summed; only the rank whose columns hold the target has its logit, the others contribute zero to a sum. "
    "Every rank then holds the same loss, so backward sums nothing: the gradient of a logit is (its softmax, "
    "exp(logit - max) / the summed exponentials, minus 1 at the target) / rows, each rank on its own columns.",
)


def _case(n: int, seed: int, shift: float) -> dict[int, tuple]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=generator) * 3 + shift
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[:2] = torch.tensor([0, VOCAB - 1])  # the first and last columns, always
    per = VOCAB // n
    return {r: (logits[:, r * per:(r + 1) * per].clone(), targets) for r in range(n)}


def _reference(outcome: RunOutcome, case: int) -> dict:
    import torch

    inputs = outcome.inputs[case]
    from .drivers import LOSS_SCALE

    logits = torch.cat([inputs[r][0] for r in sorted(inputs)], dim=1).requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits, inputs[0][1])
    (LOSS_SCALE * loss).backward()   # the driver backprops the same scaled loss
    return {"loss": loss.detach(), "grad": logits.grad}


def _label(outcome: RunOutcome, case: int) -> str:
    big = float(outcome.inputs[case][0][0].mean()) > 50
    return f"{'large logits, about 100: exp overflows float32 without the max; ' if big else ''}"


def _not_a_loss(outcome: RunOutcome) -> list[str]:
    return not_returned(outcome, "the loss, a tensor")


@judge_each(before=_not_a_loss)
def _loss(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    import torch

    at = where(rank, case, outcome)
    want = _reference(outcome, case)["loss"]
    got = result.output["loss"]
    wrong = first_difference(got.reshape(()) if got.numel() == 1 else got, want, rtol=RTOL, atol=ATOL)
    if wrong:
        hint = ""
        if torch.isneginf(got).any():
            hint = ("; -inf: every exponential underflowed to 0, so the shift subtracted is larger than the row's "
                    "max (the ranks' maxes summed?): combine the ranks' maxes with ReduceOp.MAX")
        elif not torch.isfinite(got).all():
            hint = ("; not finite: exp of a large logit overflows; subtract the row's max over the whole "
                    "vocabulary first")
        elif flows(result, result.output["forward"]).count("all_reduce") < 3:
            hint = ("; forward all-reduced fewer than 3 times: the max, the sum of exponentials and the target's "
                    "logit each need the whole row")
        else:
            hint = ("; is the max the whole row's (ReduceOp.MAX), and does only the rank holding the target's "
                    "column contribute its logit (the others masked to zero)?")
        return [f"{at}: {_label(outcome, case)}the loss {wrong}{hint}"]
    return []


@judge_each(before=_not_a_loss)
def _grads(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    import torch

    from .drivers import LOSS_SCALE

    n = outcome.nproc
    at = where(rank, case, outcome)
    rule = own_backward(result, at, "the logits", "the logits")
    if rule:
        return rule
    per = VOCAB // n
    want = _reference(outcome, case)["grad"][:, rank * per:(rank + 1) * per]
    got = result.output["logits.grad"]
    wrong = first_difference(got, want, rtol=RTOL, atol=ATOL, what=f"the logits on rank {rank}")
    if wrong:
        hint = ""
        if isinstance(got, torch.Tensor) and torch.allclose(got, want / LOSS_SCALE, rtol=RTOL, atol=ATOL):
            hint = (f": {1 / LOSS_SCALE:.3g} times too large: the checker backprops {LOSS_SCALE} × the loss, so "
                    f"backward receives grad = {LOSS_SCALE}; the gradient is off by the loss's incoming gradient: "
                    "multiply by `grad`")
        elif isinstance(got, torch.Tensor) and torch.allclose(got, want * n, rtol=RTOL, atol=ATOL):
            hint = (f": {n} times too large: backward summed the ranks' gradients; every rank computes the same "
                    "loss, so each rank's columns already get their whole gradient")
        elif isinstance(got, torch.Tensor) and torch.allclose(got, want * ROWS, rtol=RTOL, atol=ATOL):
            hint = (f": {ROWS} times too large: the loss is the mean over the {ROWS} rows, so each row's "
                    f"gradient is divided by {ROWS}")
        elif isinstance(got, torch.Tensor) and "all_reduce" in flows(result, result.output["backward"]):
            hint = ": backward all-reduced; every rank holds the same loss, so its backward sums nothing"
        return [f"{at}: {_label(outcome, case)}the gradient of this rank's columns {rank * per} to "
                f"{(rank + 1) * per - 1} {wrong}{hint}"]
    return []


@judge_each(before=_not_a_loss)
def _ledger(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    at = where(rank, case, outcome)
    # The whole logits never exist on one rank: each all-reduce carries at most one number per row.
    start, stop = result.output["forward"]
    row = ROWS * result.output["loss"].element_size()
    sent = [e["bytes"] for e in result.ledger if start <= e["start"] <= stop]  # all-reduces only (allowed_ops)
    whole = ROWS * VOCAB * result.output["loss"].element_size()
    if any(b >= whole for b in sent):
        return [f"{at}: forward all-reduced {sent} B, the whole logits' {whole} B in one call: the whole logits "
                "must never exist on one rank; all-reduce only the row's max, its sum of exponentials and its "
                "target logit"]
    if any(b > row for b in sent):
        return [f"{at}: forward all-reduced {sent} B, {max(sent) // row} numbers per row in one call (one number "
                f"per row of {ROWS} is {row} B): several quantities shared one all-reduce; the exercise asks for "
                "three separate all-reduces (the max, the sum of exponentials, the target's logit), one number "
                "per row each"]
    forward, backward = (flows(result, result.output[phase]) for phase in ("forward", "backward"))
    if (forward, backward) != (["all_reduce"] * 3, []):
        return [f"{at}: forward called {forward or 'nothing'} and backward {backward or 'nothing'}, expected "
                "three all-reduces in forward (the max, the sum of exponentials, the target's logit), none in "
                "backward"]
    return []


VOCAB_CROSS_ENTROPY = Exercise(
    id="06.vocab_cross_entropy",
    hints=HINTS,
    function="vocab_parallel_cross_entropy",
    signature="vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor",
    driver="vocab_cross_entropy",
    allowed_ops=frozenset({"all_reduce"}),
    runs=tuple(
        RunSpec(n, (lambda n, s=seed: [_case(n, s, 0.0), _case(n, s + 1, 100.0)]),
                (Item(f"the loss equals one process on every rank ({n} ranks)", 1, _loss),
                 Item(f"each rank's columns of the logits' gradient equal one process ({n} ranks)", 1, _grads),
                 Item(f"three all-reduces in forward, none in backward, none carrying the whole logits ({n} ranks)",
                      1, _ledger)), timeout_s=15)
        for n, seed in ((2, 81), (4, 82))),
)
