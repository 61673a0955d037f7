"""03.join_uneven_training: DDP on uneven inputs under Join, shadowing or stopping at the first rank out.

`train(ddp_model, optimizer, batches, stop_at_first)` trains on this rank's batches (their number
differs per rank) and returns the rank that ran out of batches first (the lowest on a tie), on every
rank. References, in this process, without torch.distributed: with `stop_at_first=False`, step k sums
the gradients of the ranks that still have a batch k and divides by the initial world size (DDP's
default under Join, a joined rank adding zeros); with `True`, every rank stops when the first runs
out: the steps all ranks took, nothing after. Judges recognise: dividing by the ranks still training,
training every batch where the ranks should have stopped, an answer known only to the rank that ran out.
"""

from __future__ import annotations

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ALL_REDUCE, ATOL, DDP_PRELOAD, LR, NAMES, RTOL, _batch, _model, _weights, counts_label

__all__ = ["JOIN_TRAINING", "first_out", "join_reference"]


def _uneven_cases(n: int, specs: list[tuple[int, tuple[int, ...], int, int, bool]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, batches per rank, rows per batch, batch seed, stop_at_first)."""
    cases = []
    for weights_seed, counts, rows, batch_seed, stop in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(sum(counts[:n]) * rows, batch_seed)
        case, start = {}, 0
        for r in range(n):
            case[r] = (weights, [(inputs[s:s + rows], targets[s:s + rows])
                                 for s in range(start, start + counts[r] * rows, rows)], LR, stop)
            start += counts[r] * rows
        cases.append(case)
    return cases


def join_reference(weights: list, batches_per_rank: list[list], lr: float, divide_by_initial: bool = True) -> dict:
    """{name: parameter} after SGD under DDP and Join, in one process.

    Step k: the gradients of the ranks that still have a batch k, summed, divided by the initial world
    size (or, with `divide_by_initial=False`, by the number of those ranks); then an SGD step. A rank
    that has joined contributes zeros. Every rank ends with these parameters: Join's post-hook
    broadcasts the last joiner's model.
    """
    import torch

    from ..lesson02.exercises import _grads

    n = len(batches_per_rank)
    params = [w.clone() for w in weights]
    for k in range(max(len(b) for b in batches_per_rank)):
        active = [b[k] for b in batches_per_rank if k < len(b)]
        total = None
        for inputs, targets in active:
            grads = _grads(params, inputs, targets)
            total = [grads[name] for name in NAMES] if total is None else \
                [t + grads[name] for t, name in zip(total, NAMES)]
        divisor = n if divide_by_initial else len(active)
        model = _model(params)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        for parameter, grad in zip(model.parameters(), total):
            parameter.grad = grad / divisor
        optimizer.step()
        params = [p.detach().clone() for p in model.parameters()]
    return dict(zip(NAMES, params))


def first_out(counts: list[int]) -> int:
    """The rank that runs out of batches first: the fewest batches, the lowest rank on a tie."""
    return counts.index(min(counts))


def _counts(outcome: RunOutcome, case: int) -> list[int]:
    return [len(outcome.inputs[case][r][1]) for r in range(outcome.nproc)]


def _label(outcome: RunOutcome, case: int) -> str:
    rows = outcome.inputs[case][0][1][0][0].shape[0]
    stop = outcome.inputs[case][0][3]
    return (f"case {case + 1} of {len(outcome.inputs)} (stop_at_first={stop}, batches of {rows} rows per rank: "
            f"{counts_label(_counts(outcome, case))})")


def _trained(stop_at_first: bool):
    def judge(outcome: RunOutcome) -> list[str]:
        n = outcome.nproc
        for case, by_rank in enumerate(outcome.results):
            weights, _, lr, stop = outcome.inputs[case][0]
            if stop != stop_at_first:
                continue
            batches = [outcome.inputs[case][r][1] for r in range(n)]
            steps = min(map(len, batches)) if stop else None
            expected = join_reference(weights, [b[:steps] for b in batches], lr)
            last = max(range(n), key=lambda r: (len(batches[r]), r))  # a rank with the most batches
            for rank in range(n):
                got = by_rank[rank].output["params"]
                for name in NAMES:
                    wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                    if not wrong:
                        continue
                    hint = ""
                    by_active = join_reference(weights, [b[:steps] for b in batches], lr, divide_by_initial=False)
                    every_batch = join_reference(weights, batches, lr)
                    if not first_difference(got[name], by_active[name], rtol=RTOL, atol=ATOL):
                        hint = (": that is the training with divide_by_initial_world_size=False (each step divided "
                                "by the ranks still training); keep the default, True: a joined rank contributes "
                                f"zeros and the sum is divided by the initial world size, {n}")
                    elif stop and not first_difference(got[name], every_batch[name], rtol=RTOL, atol=ATOL):
                        hint = (f": that is the training of every batch (the ranks that ran out shadowed the "
                                f"others); with stop_at_first=True every rank stops after the {steps} steps that "
                                "all ranks took")
                    elif first_difference(got[name], by_rank[last].output["params"][name], rtol=RTOL, atol=ATOL):
                        hint = f": rank {rank} ends with other parameters than rank {last}"
                    return [f"rank {rank}, {_label(outcome, case)}: {name} {wrong}{hint}"]
        return []

    judge.__doc__ = f"Every rank ends with one process's parameters (stop_at_first={stop_at_first})."
    return judge


def _reported(outcome: RunOutcome) -> list[str]:
    """Every rank returns the rank that ran out of batches first, the lowest on a tie."""
    for case, by_rank in enumerate(outcome.results):
        counts = _counts(outcome, case)
        expected = first_out(counts)
        returned = {rank: by_rank[rank].output["returned"] for rank in range(outcome.nproc)}
        for rank, got in returned.items():
            if got == expected and type(got) is int:
                continue
            where = f"rank {rank}, {_label(outcome, case)}: returned {got!r}, expected {expected}"
            knew = sorted(r for r, v in returned.items() if v == expected)
            tied = [r for r, c in enumerate(counts) if c == min(counts)]
            if knew:
                return [f"{where}: only rank{'s' if len(knew) > 1 else ''} {', '.join(map(str, knew))} returned it; "
                        "every rank must return the same rank, so the others have to learn it"]
            if type(got) is not int:
                return [f"{where}: every rank returns the rank that ran out first, an int, the same on every rank"]
            if got in tied:
                return [f"{where}: ranks {', '.join(map(str, tied))} ran out together; return the lowest"]
            return [where]
    return []


JOIN_TRAINING = Exercise(
    id="03.join_uneven_training",
    function="train",
    signature=("train(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, "
               "batches: list[tuple[torch.Tensor, torch.Tensor]], stop_at_first: bool) -> int"),
    driver="ddp_join_training",
    allowed_ops=ALL_REDUCE,
    preload=DDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _uneven_cases(n, [(31, (3, 2), 3, 131, False), (38, (3, 2), 3, 138, True)]),
                (Item("shadowing: every rank ends with one process's parameters (2 ranks: 3 and 2 batches)", 1,
                      _trained(False)),
                 Item("stopping at the first rank out: every rank ends with the parameters of the steps all "
                      "ranks took (2 ranks)", 1, _trained(True)),
                 Item("every rank returns the rank that ran out first (2 ranks)", 1, _reported)), timeout_s=10),
        RunSpec(3, lambda n: _uneven_cases(n, [(32, (3, 4, 2), 3, 132, False), (39, (4, 2, 2), 3, 139, True)]),
                (Item("shadowing: every rank ends with one process's parameters (3 ranks: 3, 4 and 2 batches)", 1,
                      _trained(False)),
                 Item("stopping at the first rank out: every rank ends with the parameters of the steps all "
                      "ranks took (3 ranks: 4, 2 and 2 batches)", 1, _trained(True)),
                 Item("every rank returns the rank that ran out first, a tie included (3 ranks)", 1, _reported)),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 03, section 3 'Join: the ranks that run out shadow the others' and section 5 "
        "'throw_on_early_termination and enable'.",
        "torch.distributed.algorithms.join.Join([ddp_model], throw_on_early_termination=...), the RuntimeError it "
        "raises, and dist.all_reduce(tensor, op=dist.ReduceOp.MIN).",
        "Run the loop inside the context manager, with the option that makes every rank stop when asked to. Then "
        "agree on who ran out first: each rank knows its own number of batches, and one collective in which every "
        "rank takes part can turn those into the same answer everywhere (ties: the lowest rank).",
    ),
)
