"""05.accumulate: one optimizer step over K micro-batches that trades memory for traffic: each group
all-gathered once (in the first micro-batch's forward) and reduce-scattered once (in the last backward), the
parameters sharded again when the call returns.

Judged: the shards after the step against one process's SGD step on every rank's micro-batches together; the
ledger's all-gathers and reduce-scatters per micro-batch; every parameter a DTensor again at the end. The usual
mistakes are named: the lesson's recipe (sync off only: every micro-batch gathers again), resharding kept after
forward or after backward, the parameters left gathered, sync never back on, the loss not divided by K.
"""

from __future__ import annotations

import math

from ....vocabulary import data_flow
from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (FSDP2_OPS, FSDP2_PRELOAD, LR, TOY_2, TOY_3, batch, rows_text, rows_wrong, sgd_reference,
                     shard_rows, toy, toy_weights)

__all__ = ["ACCUMULATE"]

HINTS = (
    "Reread lesson 05, section 6 '`reshard_after_forward`, `unshard`/`reshard`' and section 8's part on "
    "accumulation.",
    "FSDPModule's setters: set_requires_gradient_sync, set_reshard_after_forward, set_reshard_after_backward "
    "(each recurse=True by default); optimizer.step() once.",
    "A group is gathered again whenever it was resharded: after a forward, or after a backward. Keep every "
    "group gathered from the first forward to the last backward and reshard it only after that one; keep the "
    "reduce-scatter for the last backward; scale each loss so the K backwards add up to the mean over this "
    "rank's rows.",
)

def _micro_case(n: int, sizes: dict, weights_seed: int, k: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    """Rank r gets K micro-batches of `rows` rows, its own part of one batch of n * k * rows."""
    weights = toy_weights(sizes, weights_seed)
    inputs, targets = batch(n * k * rows, sizes["dim"], sizes["out"], batch_seed)
    case = {}
    for r in range(n):
        starts = [(r * k + i) * rows for i in range(k)]
        case[r] = (sizes, weights, [(inputs[s:s + rows], targets[s:s + rows]) for s in starts], LR)
    return case


def _micro_label(outcome: RunOutcome, case: int) -> str:
    sizes, _, micro_batches, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} (ToyModel with {sizes['layers']} Blocks, "
            f"K={len(micro_batches)} micro-batches of {rows_text(micro_batches[0][0].shape[0])} per rank)")


def _accumulated(outcome: RunOutcome) -> list[str]:
    """Every rank's rows of every parameter equal one process's SGD step on all micro-batches of all ranks,
    and the gradients were zeroed after it."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, lr = outcome.inputs[case][0]
        k = len(outcome.inputs[case][0][2])
        pairs = [pair for r in range(n) for pair in outcome.inputs[case][r][2]]
        inputs, targets = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        expected = sgd_reference(toy(sizes, weights), [(inputs, targets)], lr)
        for rank, result in sorted(by_rank.items()):
            if result.output.get("gathered"):
                return [f"rank {rank}, {_micro_label(outcome, case)}: after the step {result.output['gathered'][0]} "
                        "is still the whole gathered tensor, as before the step: the optimizer stepped the shards, "
                        "which the model no longer reads (see the last item)"]
            kept = result.output.get("grads_kept", [])
            if kept:
                return [f"rank {rank}, {_micro_label(outcome, case)}: after the step {kept[0]}.grad still holds the "
                        f"gradient ({len(kept)} parameter{'s' * (len(kept) != 1)} in all): the statement asks for the "
                        "gradients zeroed after the step, so the next step starts from none"]
            for name, full in expected.items():
                got = result.output["shards"][name]
                wrong = rows_wrong(got, full, rank, n, name)
                if not wrong:
                    continue
                start, stop = shard_rows(full.shape[0], n, rank)
                before, want = weights[name][start:stop], full[start:stop]
                hint = ""
                if got.shape == want.shape:
                    step, expected_step = got - before, want - before
                    ratios = {f"{k} times too large: divide each micro-batch's loss by K={k}, so that the K backwards "
                              "add up to the mean over the batch": k,
                              f"{n} times too small: FSDP's reduce-scatter already averages over the {n} ranks; "
                              f"divide the loss by K={k} only": 1 / n,
                              f"{n * k} times too small: divide each micro-batch's loss by K={k} only (FSDP averages "
                              "over the ranks)": 1 / (n * k)}
                    if torch.equal(got, before):
                        hint = (": the parameter did not change, so no gradient reached this rank's shard: FSDP "
                                "reduce-scatters only in a backward with gradient sync on; turn it back on "
                                "(set_requires_gradient_sync(True)) for the last micro-batch, then optimizer.step()")
                    for words, ratio in ratios.items():
                        if torch.allclose(step, ratio * expected_step, rtol=1e-3, atol=1e-7):
                            hint = f": the update is {words}"
                return [f"rank {rank}, {_micro_label(outcome, case)}: after the step {wrong}{hint}"]
    return []


def _per_micro_batch(result, k: int, flow: str) -> list[int] | None:
    """How many calls of `flow` ("all_gather", "reduce_scatter") the ledger holds in each of the K micro-batches
    (from one forward's start to the next's; the last to the function's end); None if the model did not run K
    forwards."""
    starts = result.output["starts"]
    if len(starts) != k:
        return None
    ends = starts[1:] + [math.inf]
    times = [e["start"] for e in result.ledger if data_flow(e["op"]) == flow]
    return [sum(1 for t in times if start <= t < end) for start, end in zip(starts, ends)]


def _counts(got: list[int]) -> str:
    return ", ".join(f"{c} in micro-batch {i + 1}" for i, c in enumerate(got))


def _gathered_once(outcome: RunOutcome) -> list[str]:
    """The ledger: every group all-gathers once, in the first micro-batch, and never again."""
    for case, rank, result in each_result(outcome):
        sizes, _, micro_batches, _ = outcome.inputs[case][0]
        k, units = len(micro_batches), sizes["layers"] + 1
        where = f"rank {rank}, {_micro_label(outcome, case)}"
        got = _per_micro_batch(result, k, "all_gather")
        if got is None:
            return [f"{where}: the model ran forward {len(result.output['starts'])} times, expected once per "
                    f"micro-batch ({k})"]
        expected = [units] + [0] * (k - 1)
        if got == expected:
            continue
        should = f"expected {units} in micro-batch 1 (one per group) and none after: all-gathers {_counts(got)}"
        blocks = units - 1
        if got == [units + blocks] * k:
            hint = ("every micro-batch gathers again, as with gradient sync off alone: that keeps the gradients, "
                    "not the parameters; FSDP still reshards each group after its forward and after its backward")
        elif got[0] > units and all(c == blocks for c in got[1:]):
            hint = ("the Blocks are gathered again in every backward: they are resharded after each forward "
                    "(reshard_after_forward), though they stay gathered after each backward")
        elif got[0] > units:
            hint = ("the Blocks are gathered a second time in micro-batch 1's backward: they were resharded after "
                    "its forward (reshard_after_forward)")
        else:
            hint = ("each later forward gathers again: the groups were resharded after the backward before it "
                    "(reshard_after_backward)")
        return [f"{where}: {should}: {hint}"]
    return []


def _synced_once(outcome: RunOutcome) -> list[str]:
    """The ledger: no reduce-scatter in the first K-1 micro-batches; in the last, one per Block and the root's."""
    for case, rank, result in each_result(outcome):
        sizes, _, micro_batches, _ = outcome.inputs[case][0]
        k, units = len(micro_batches), sizes["layers"] + 1
        expected = [0] * (k - 1) + [units]
        where = f"rank {rank}, {_micro_label(outcome, case)}"
        got = _per_micro_batch(result, k, "reduce_scatter")
        if got is None:
            return [f"{where}: the model ran forward {len(result.output['starts'])} times, expected once per "
                    f"micro-batch ({k})"]
        if got == expected:
            continue
        should = (f"expected none before the last micro-batch and {units} in it (one per Block and the root's): "
                  f"reduce-scatters {_counts(got)}")
        if not any(got):
            hint = ("gradient sync stayed off, so nothing reached the shards; turn it back on "
                    "(model.set_requires_gradient_sync(True)) before the last micro-batch's backward")
        elif got[:-1] == [units - 1] * (k - 1):
            hint = ("the Blocks still reduce-scatter every micro-batch: a setter called with recurse=False changes "
                    "only the root's own group")
        elif got[:-1] == [units] * (k - 1):
            hint = f"sync was never turned off: it must be off for each of the first K-1={k - 1} backwards"
        else:
            hint = "sync off for the first K-1 micro-batches, on for the last"
        return [f"{where}: {should}: {hint}"]
    return []


def _sharded_again(outcome: RunOutcome) -> list[str]:
    """When the function returns, every parameter is a DTensor again (each group resharded)."""
    for case, rank, result in each_result(outcome):
        gathered = result.output["gathered"]
        if gathered:
            return [f"rank {rank}, {_micro_label(outcome, case)}: {gathered[0]} is still gathered (a whole tensor, "
                    f"not a DTensor) when your function returns ({len(gathered)} parameters in all): the model keeps "
                    "a whole copy per rank, and the next forward would read it, not the shards the optimizer "
                    "stepped; let the last backward reshard"]
    return []


ACCUMULATE = Exercise(
    id="05.accumulate",
    hints=HINTS,
    function="accumulate",
    signature=("accumulate(model: FSDPModule, optimizer: torch.optim.Optimizer, "
               "micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None"),
    driver="fsdp2_accumulation",
    allowed_ops=FSDP2_OPS,
    preload=FSDP2_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_micro_case(n, TOY_2, 55, 3, 2, 155)],
                (Item("one step equals one process on the whole batch (2 ranks, K=3)", 1, _accumulated),
                 Item("each group all-gathers once, in the first micro-batch (2 ranks, K=3)", 1, _gathered_once),
                 Item("reduce-scatters only in the last micro-batch (2 ranks, K=3)", 1, _synced_once),
                 Item("every parameter is sharded again at the end (2 ranks, K=3)", 1, _sharded_again)),
                timeout_s=10),
        RunSpec(4, lambda n: [_micro_case(n, TOY_3, 56, 2, 1, 156)],
                (Item("one step equals one process on the whole batch (4 ranks, K=2)", 1, _accumulated),
                 Item("each group all-gathers once, in the first micro-batch (4 ranks, K=2)", 1, _gathered_once),
                 Item("reduce-scatters only in the last micro-batch (4 ranks, K=2)", 1, _synced_once)),
                timeout_s=10),
    ),
)
