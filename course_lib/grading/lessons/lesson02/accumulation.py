"""02.no_sync_accumulation: one optimizer step over K micro-batches, DDP synchronising once."""

from __future__ import annotations

from ....units import binary_bytes
from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ALL_REDUCE, ATOL, DDP_PRELOAD, LR, NAMES, RTOL, _batch, _sgd_step, _weights

__all__ = ["ACCUMULATION"]

def _micro_batch_cases(n: int, specs: list[tuple[int, int, int, int]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, K, micro-batch size, batch seed): rank r gets K micro-batches of its own."""
    cases = []
    for weights_seed, k, size, batch_seed in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(n * k * size, batch_seed)
        case = {}
        for r in range(n):
            rows = [(r * k + i) * size for i in range(k)]
            case[r] = (weights, [(inputs[s:s + size], targets[s:s + size]) for s in rows], LR)
        cases.append(case)
    return cases



def _micro_label(outcome: RunOutcome, case: int) -> str:
    micro_batches = outcome.inputs[case][0][1]
    return (f"case {case + 1} of {len(outcome.inputs)} (K={len(micro_batches)} micro-batches of "
            f"{micro_batches[0][0].shape[0]} per rank)")


def _stepped(outcome: RunOutcome) -> list[str]:
    """Every rank's parameters equal one process's SGD step on all ranks' micro-batches together."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights, _, lr = outcome.inputs[case][0]
        pairs = [pair for r in range(n) for pair in outcome.inputs[case][r][1]]
        inputs, targets = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        expected = _sgd_step(weights, inputs, targets, lr)
        k = len(outcome.inputs[case][0][1])
        first = by_rank[0].output["params"]
        for rank in range(n):
            got = by_rank[rank].output["params"]
            where = f"rank {rank}, {_micro_label(outcome, case)}"
            for index, name in enumerate(NAMES):
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = ""
                if any(first_difference(by_rank[r].output["params"][name], first[name], rtol=RTOL, atol=ATOL)
                       for r in range(n)):
                    hint = (": the ranks hold different parameters, so no gradient was all-reduced; run the "
                            "last micro-batch's backward outside no_sync()")
                else:
                    step, expected_step = got[name] - weights[index], expected[name] - weights[index]
                    if torch.allclose(step, k * expected_step, rtol=1e-3, atol=1e-6):
                        hint = f": the update is {k} times too large; divide each micro-batch's loss by K={k}"
                    elif torch.allclose(got[name], weights[index]):
                        hint = ": the parameter did not change; call optimizer.step() after the last backward"
                return [f"{where}: {name} {wrong}{hint}"]
    return []


def _synchronised_once(outcome: RunOutcome) -> list[str]:
    """The ledger: one all_reduce per DDP bucket per step, each of the bucket's bytes."""
    for case, by_rank in enumerate(outcome.results):
        k = len(outcome.inputs[case][0][1])
        for rank, result in sorted(by_rank.items()):
            buckets = result.output["buckets"]
            expected = [4 * numel for numel in buckets]  # float32 gradients
            got = [entry["bytes"] for entry in result.ledger if entry["op"] == "all_reduce"]
            if got == expected:
                continue
            where = f"rank {rank}, {_micro_label(outcome, case)}"
            plural = "s" if len(expected) != 1 else ""
            should = f"expected {len(expected)} (one per DDP bucket{plural}, on the last backward only)"
            if not got:
                return [f"{where}: no all_reduce, {should}: DDP never synchronised; run the last backward "
                        "outside no_sync()"]
            hint = ""
            if got == expected * (len(got) // len(expected)) and len(got) // len(expected) > 1:
                hint = (f": DDP synchronised {len(got) // len(expected)} times; the first K-1={k - 1} micro-batches' "
                        "forward and backward both belong inside ddp_model.no_sync() (DDP decides in the forward "
                        "whether the next backward communicates)")
            return [f"{where}: {len(got)} all_reduce calls of {', '.join(binary_bytes(b) for b in got)}, "
                    f"{should}{hint}"]
    return []


def _gradients_cleared(outcome: RunOutcome) -> list[str]:
    """No gradient left after the step (optimizer.zero_grad(): None, or zeros)."""
    for case, rank, result in each_result(outcome):
        for name in NAMES:
            grad = result.output["grads"][name]
            if grad is not None and bool(grad.ne(0).any()):
                return [f"rank {rank}, {_micro_label(outcome, case)}: {name}.grad is not zero after the step; "
                        "call optimizer.zero_grad() after optimizer.step(), or the next step adds to it"]
    return []


ACCUMULATION = Exercise(
    id="02.no_sync_accumulation",
    function="accumulation_step",
    signature=("accumulation_step(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, "
               "micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None"),
    driver="ddp_accumulation",
    allowed_ops=ALL_REDUCE,
    preload=DDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _micro_batch_cases(n, [(4, 2, 3, 41), (5, 3, 2, 42)]),
                (Item("one step equals one process on the whole batch (2 ranks, K=2 and K=3)", 1, _stepped),
                 Item("DDP all-reduces once per bucket per step (K-1 backwards inside no_sync)", 1,
                      _synchronised_once),
                 Item("leaves no gradient behind (zero_grad after the step)", 1, _gradients_cleared))),
        RunSpec(3, lambda n: _micro_batch_cases(n, [(6, 2, 2, 43)]),
                (Item("one step equals one process on the whole batch (3 ranks, K=2)", 1, _stepped),)),
    ),
    hints=(
        "Reread lesson 02, section 5 'Gradient accumulation with no_sync'.",
        "DistributedDataParallel.no_sync() (a context manager); torch.optim.Optimizer's step and zero_grad.",
        "Run the forward and backward of every micro-batch but the last inside the context (DDP decides in "
        "forward whether the coming backward synchronises) and the last one outside it, so that one backward "
        "all-reduces the accumulated sum. Scale each micro-batch's loss so that the K losses add up to their "
        "mean. Then take one optimizer step and clear the gradients.",
    ),
)

