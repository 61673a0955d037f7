"""06.vocab_embedding: a vocabulary-parallel embedding by hand (what RowwiseParallel does to an nn.Embedding).

Each rank holds its rows of the [vocab, dim] weight; a token outside them gives a zero row, and one all-reduce
sums the ranks' rows into every token's embedding; backward, written by hand in the learner's autograd Function,
adds each token's output gradient into the row it holds (no collective). Judged against one process: the
output on every rank, each rank's rows of the weight's gradient, computed by the learner's own backward (the
graph from the output to the weight runs through their autograd.Function); from the ledger, one all-reduce in forward (of
the output's bytes, never the table's) and none in backward. The usual mistakes are named: tokens not masked (another rank's token read from this rank's
rows), the all-reduce's backward summing again, no autograd.Function (autograd differentiating through
an in-place all-reduce, which it takes for the identity).
"""

from __future__ import annotations

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, RTOL, flows, judge_each, not_a_module, own_backward, where

__all__ = ["VOCAB_EMBEDDING"]

VOCAB, DIM = 16, 4  # 8 rows per rank on 2 ranks, 4 on 4

HINTS = (
    "Reread lesson 06, section 4: the embedding `RowwiseParallel(input_layouts=Replicate())`, and section 3's g.",
    "torch.nn.functional.embedding, a boolean mask of the tokens in this rank's range, dist.all_reduce; in "
    "backward, ctx.save_for_backward and Tensor.index_add_.",
    "Keep this rank's rows of the weight; look up only the tokens in this rank's range (shifted to local row "
    "numbers), give the others a zero row, and sum the ranks' results once; every rank holds the whole output's "
    "gradient, so backward adds each of its own tokens' gradient into that token's local row and sums nothing.",
)


def _case(n: int, seed: int) -> dict[int, tuple]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, DIM, generator=generator)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=generator)
    tokens[0, :2] = torch.tensor([0, VOCAB - 1])  # the first and last rows of the vocabulary, always
    return {r: (weight, tokens) for r in range(n)}


def _reference(weight, tokens) -> dict:
    import torch

    from .drivers import ramp

    embedding = torch.nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        embedding.weight.copy_(weight)
    out = embedding(tokens)
    (out * ramp(out)).sum().backward()
    return {"out": out.detach(), "weight": embedding.weight.grad}


def _rows(rank: int, n: int) -> slice:
    per = VOCAB // n
    return slice(rank * per, (rank + 1) * per)


@judge_each(before=not_a_module)
def _held(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    per = VOCAB // outcome.nproc
    if result.output["params"] != {"weight": [per, DIM]}:
        shown = ", ".join(f"{k} {v}" for k, v in result.output["params"].items()) or "none"
        return [f"{where(rank, case, outcome)}: VocabEmbedding holds {shown}; expected exactly weight "
                f"[{per}, {DIM}]: this rank's {per} of the {VOCAB} rows of the vocabulary"]
    return []


@judge_each(before=_held)
def _output(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    import torch

    weight, tokens = outcome.inputs[case][rank]
    want = _reference(weight, tokens)["out"]
    got = result.output["out"]
    wrong = first_difference(got, want, rtol=RTOL, atol=ATOL)
    if wrong:
        hint = ""
        if isinstance(got, torch.Tensor) and got.shape == want.shape:
            if "all_reduce" not in flows(result, result.output["forward"]):
                hint = ": forward summed nothing, so each token has only the rank that holds its row's term"
            else:
                hint = (": a token outside this rank's rows must give a zero row (mask it), or the sum adds "
                        "rows that belong to other tokens")
        return [f"{where(rank, case, outcome)}: the output {wrong}{hint}"]
    return []


@judge_each(before=_held)
def _grads(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    import torch

    n = outcome.nproc
    weight, tokens = outcome.inputs[case][rank]
    rule = own_backward(result, where(rank, case, outcome), "the weight", "the weight")
    if rule:
        return rule
    want = _reference(weight, tokens)["weight"][_rows(rank, n)]
    got = result.output["grads"]["weight"]
    wrong = first_difference(got, want, rtol=RTOL, atol=ATOL, what=f"weight on rank {rank}")
    if wrong:
        hint = ""
        if isinstance(got, torch.Tensor) and torch.allclose(got, want * n, rtol=RTOL, atol=ATOL):
            hint = (f": {n} times too large: backward summed the ranks' gradients again; each rank's rows get "
                    "their gradient from the whole output's gradient, which every rank already holds")
        rows = _rows(rank, n)
        return [f"{where(rank, case, outcome)}: the gradient of this rank's rows {rows.start} to {rows.stop - 1} "
                f"of the weight {wrong}{hint}"]
    return []


@judge_each(before=_held)
def _ledger(outcome: RunOutcome, case: int, rank: int, result) -> list[str]:
    at = where(rank, case, outcome)
    forward, backward = (flows(result, result.output[phase]) for phase in ("forward", "backward"))
    if (forward, backward) != (["all_reduce"], []):
        return [f"{at}: forward called {forward or 'nothing'} and backward {backward or 'nothing'}, expected one "
                "all-reduce in forward (after the masked lookup, summing the ranks' rows) and nothing in backward"]
    # What the all-reduce carried: the looked-up rows (the output's size), never the table. Summing the
    # zero-padded shards rebuilds the whole table on every rank (FSDP's gather, done with an all-reduce).
    start, stop = result.output["forward"]
    sent = next(e["bytes"] for e in result.ledger if start <= e["start"] <= stop)
    out = result.output["out"]
    rows = out.numel() * out.element_size()
    if sent != rows:
        table = " (the whole table's size)" if sent == VOCAB * DIM * out.element_size() else ""
        return [f"{at}: the all-reduce carried {sent} B{table}, expected {rows} B, the looked-up rows "
                f"{list(out.shape)}: the whole table must never be rebuilt on one rank; sum the ranks' "
                "masked rows of the output, not their shards of the weight"]
    return []


VOCAB_EMBEDDING = Exercise(
    id="06.vocab_embedding",
    hints=HINTS,
    function="VocabEmbedding",
    signature="VocabEmbedding(embedding: nn.Embedding) -> nn.Module",
    driver="vocab_embedding",
    allowed_ops=frozenset({"all_reduce"}),
    runs=tuple(
        RunSpec(n, (lambda n, s=seed: [_case(n, s)]),
                (Item(f"output equals one process on every rank ({n} ranks)", 1, _output),
                 Item(f"each rank's rows of the weight's gradient equal one process ({n} ranks)", 1, _grads),
                 Item(f"one all-reduce of the output's size in forward, none in backward ({n} ranks)", 1,
                      _ledger)), timeout_s=15)
        for n, seed in ((2, 71), (4, 72))),
)
