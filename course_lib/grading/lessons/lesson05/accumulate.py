"""05.accumulate: one optimizer step over K micro-batches, FSDP reduce-scattering in the last backward only.

Judged: the shards after the step against one process's SGD step on every rank's micro-batches together;
the ledger's reduce-scatters per micro-batch. The usual mistakes are named: sync never turned back on, sync
turned off on the root only (`recurse=False`), the loss not divided by K, or divided by the world size too.
"""

from __future__ import annotations

import math

from ....vocabulary import data_flow
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (FSDP2_OPS, FSDP2_PRELOAD, LR, TOY_2, TOY_3, batch, rows_text, rows_wrong, sgd_reference,
                     shard_rows, toy, toy_weights)

__all__ = ["ACCUMULATE"]

HINTS = (
    "Reread lesson 05, section 8 'Accumulation, clipping, HSDP', the part on accumulation.",
    "FSDPModule.set_requires_gradient_sync(requires_gradient_sync, *, recurse=True), and "
    "optimizer.step() once.",
    "Keep FSDP from reduce-scattering in every backward but the last, on every FSDP module; scale each "
    "micro-batch's loss so that the K backwards add up to the mean over this rank's rows (FSDP's "
    "reduce-scatter already averages over the ranks); step once, after the last backward.",
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


def _synced_once(outcome: RunOutcome) -> list[str]:
    """The ledger: no reduce-scatter in the first K-1 micro-batches; in the last, one per Block and the root's."""
    for case, by_rank in enumerate(outcome.results):
        sizes, _, micro_batches, _ = outcome.inputs[case][0]
        k, units = len(micro_batches), sizes["layers"] + 1
        expected = [0] * (k - 1) + [units]
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_micro_label(outcome, case)}"
            starts = result.output["starts"]
            if len(starts) != k:
                return [f"{where}: the model ran forward {len(starts)} times, expected once per micro-batch ({k})"]
            ends = starts[1:] + [math.inf]
            scatters = [e["start"] for e in result.ledger if data_flow(e["op"]) == "reduce_scatter"]
            got = [sum(1 for t in scatters if start <= t < end) for start, end in zip(starts, ends)]
            if got == expected:
                continue
            counts = ", ".join(f"{c} in micro-batch {i + 1}" for i, c in enumerate(got))
            should = (f"expected none before the last micro-batch and {units} in it (one per Block and the root's): "
                      f"reduce-scatters {counts}")
            if not any(got):
                hint = ("gradient sync stayed off, so nothing reached the shards; turn it back on "
                        "(model.set_requires_gradient_sync(True)) before the last micro-batch's backward")
            elif got[:-1] == [units - 1] * (k - 1):
                hint = ("the Blocks still reduce-scatter every micro-batch: set_requires_gradient_sync(False, "
                        "recurse=False) turns off only the root's own group; the default, recurse=True, turns off "
                        "every FSDP module below it too")
            elif got[:-1] == [units] * (k - 1):
                hint = ("sync was never turned off: call model.set_requires_gradient_sync(False) before each of the "
                        f"first K-1={k - 1} backwards")
            else:
                hint = "sync off for the first K-1 micro-batches, on for the last"
            return [f"{where}: {should}: {hint}"]
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
                 Item("reduce-scatters only in the last micro-batch (2 ranks, K=3)", 1, _synced_once)),
                timeout_s=10),
        RunSpec(4, lambda n: [_micro_case(n, TOY_3, 56, 2, 1, 156)],
                (Item("one step equals one process on the whole batch (4 ranks, K=2)", 1, _accumulated),
                 Item("reduce-scatters only in the last micro-batch (4 ranks, K=2)", 1, _synced_once)),
                timeout_s=10),
    ),
)
