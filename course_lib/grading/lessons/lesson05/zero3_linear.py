"""05.zero3_linear: ZeRO-3 by hand, as a module: a Linear whose weight and bias are sharded by rows, with a
`torch.autograd.Function` that all-gathers the weight in forward, frees it, gathers it again in backward and
reduce-scatters (averages) the gradient.

The ranks put two of the learner's `ShardedLinear` in a model, Linear -> ReLU -> Linear, and train it with
SGD on their rows of a batch. Judged against one process on the whole batch: the outputs and the shards'
gradients of the first step, the shards after 3 steps; from autograd's saved tensors, the storages the forward
made that are still alive after it, and the ledger: the whole weight is not kept from forward to backward
(nothing of its size is saved for backward or held elsewhere, and backward all-gathers again); the gradient is
reduce-scattered, not all-reduced. The usual mistakes are named: the gathered weight kept for backward (a
gather-only Function under `F.linear`, or the weight put on `ctx` as an attribute, which saved-tensor hooks do
not see), a sum for an average, an all-reduce for a reduce-scatter, the whole gradient or this rank's own
gradient returned. What is not caught: a whole weight kept as N separate pieces (each a shard's size).
"""

from __future__ import annotations

from ....vocabulary import data_flow
from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, FSDP2_PRELOAD, LR, RTOL, batch, floats, rows_text, shard_rows, weights_of

__all__ = ["LAYERS", "STEPS", "ZERO3_LINEAR", "ZERO3_OPS"]

STEPS = 3
# (features, hidden, out) per world size: out and hidden divide by it (no padding), and no activation or shard
# has as many elements as a whole weight (so a saved tensor of that size is the gathered weight).
LAYERS = {2: (6, 8, 4), 4: (5, 12, 4)}
LAYER_NAMES = {"0": "layer 1", "2": "layer 2"}
ZERO3_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce"})

HINTS = (
    "Reread lesson 05, section 3 (what a unit gathers in forward and backward, and frees) and section 6 "
    "'reshard_after_forward', the case True; the exercise's own paragraph on torch.autograd.Function.",
    "torch.autograd.Function (forward(ctx, ...), backward(ctx, grad_output), ctx.save_for_backward), "
    "dist.all_gather_single and dist.reduce_scatter_single with op=dist.ReduceOp.AVG (torch 2.13's names; "
    "all_gather_into_tensor and reduce_scatter_tensor are the older, deprecated ones).",
    "Make one Function do the layer's whole computation: in forward gather the weight, compute, and save "
    "only what is small (the input and the shards); in backward gather the weight again for the input's "
    "gradient, compute the whole weight's and bias's gradients from this rank's rows, and reduce-scatter "
    "them so that each rank receives only its rows, averaged.",
)


def _case(n: int, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    from .drivers import two_layers

    features, hidden, out = LAYERS[n]
    weights = weights_of(lambda: two_layers(features, hidden, out), weights_seed)
    inputs, targets = batch(n * rows, features, out, batch_seed)
    return {r: (weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR, STEPS)
            for r in range(n)}


def _label(outcome: RunOutcome, case: int) -> str:
    weights, inputs = outcome.inputs[case][0][:2]
    hidden, features = weights["0.weight"].shape
    out = weights["2.weight"].shape[0]
    return (f"case {case + 1} of {len(outcome.inputs)} (Linear({features}, {hidden}) -> ReLU -> Linear({hidden}, "
            f"{out}), {rows_text(inputs.shape[0])} of the batch per rank)")


def _one_process(outcome: RunOutcome, case: int, steps: int, rank: int | None = None):
    """(outputs, {name: gradient}, {name: parameter after `steps` SGD steps}) of one process on the whole batch,
    or on `rank`'s rows only."""
    import torch

    from .drivers import two_layers

    by_rank = outcome.inputs[case]
    weights, lr = by_rank[0][0], by_rank[0][3]
    ranks = range(outcome.nproc) if rank is None else [rank]
    inputs, targets = torch.cat([by_rank[r][1] for r in ranks]), torch.cat([by_rank[r][2] for r in ranks])
    hidden, features = weights["0.weight"].shape
    model = two_layers(features, hidden, weights["2.weight"].shape[0])
    model.load_state_dict(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    outputs, grads = None, {}
    for step in range(steps):
        optimizer.zero_grad()
        result = model(inputs)
        torch.nn.functional.mse_loss(result, targets).backward()
        if step == 0:
            outputs = result.detach()
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
    return outputs, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _problem(outcome: RunOutcome) -> list[str]:
    """The module's own problem (its parameters are not this rank's rows), said the same for every item."""
    for case, rank, result in each_result(outcome):
        if "problem" in result.output:
            return [f"rank {rank}, {_label(outcome, case)}: {result.output['problem']}"]
    return []


def _name(name: str) -> str:
    """'0.weight' -> "layer 1's weight"."""
    layer, kind = name.split(".")
    return f"{LAYER_NAMES[layer]}'s {kind}"


def _values(outcome: RunOutcome) -> list[str]:
    """The first forward's outputs are one process's rows; each shard's gradient is its rows of one process's
    gradient on the whole batch (the mean loss over every rank's rows)."""
    problem = _problem(outcome)
    if problem:
        return problem
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        outputs, grads, _ = _one_process(outcome, case, 1)
        rows = outcome.inputs[case][0][1].shape[0]
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_label(outcome, case)}"
            wrong = first_difference(result.output["outputs"], outputs[rank * rows:(rank + 1) * rows],
                                     rtol=RTOL, atol=ATOL)
            if wrong:
                return [f"{where}: the model's output on this rank's rows {wrong}: the forward must compute with the "
                        "whole weight and bias, gathered in rank order"]
            own = None
            for name, full in grads.items():
                got = result.output["grads"][name]
                start, stop = shard_rows(full.shape[0], n, rank)
                if isinstance(got, str):
                    return [f"{where}: the shard of {_name(name)} has no gradient ({got}) after backward: the "
                            "Function's backward must return one gradient per input of forward, the shard's "
                            "included"]
                wrong = first_difference(got, full[start:stop], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = ""
                if got.shape == full.shape:
                    hint = (f": that is the whole gradient, not this rank's rows {start} to {stop - 1}; reduce-scatter "
                            "it, so that each rank receives only its rows")
                elif not first_difference(got, n * full[start:stop], rtol=1e-4, atol=ATOL):
                    hint = (f": that is {n} times the average, the sum over the ranks; average it (each rank's loss "
                            "is the mean over its own rows)")
                else:
                    own = own or _one_process(outcome, case, 1, rank)[1]
                    if not first_difference(got, own[name][start:stop], rtol=1e-4, atol=ATOL):
                        hint = (": that is this rank's own gradient, from its rows of the batch only: it was not "
                                "reduced over the ranks")
                return [f"{where}: the gradient of {_name(name)} shard (rows {start} to {stop - 1} of "
                        f"{full.shape[0]}) {wrong}{hint}"]
    return []


def _stepped(outcome: RunOutcome) -> list[str]:
    """After the steps every shard equals its rows of one process's parameter after as many SGD steps."""
    problem = _problem(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        steps = outcome.inputs[case][0][4]
        _, _, expected = _one_process(outcome, case, steps)
        for rank, result in sorted(by_rank.items()):
            for name, full in expected.items():
                start, stop = shard_rows(full.shape[0], outcome.nproc, rank)
                wrong = first_difference(result.output["params"][name], full[start:stop], rtol=RTOL, atol=ATOL)
                if wrong:
                    return [f"rank {rank}, {_label(outcome, case)}: after {steps} SGD steps the shard of "
                            f"{_name(name)} (rows {start} to {stop - 1} of {full.shape[0]}) {wrong}"]
    return []


def _in(ledger: list[dict], span: list[float], flow: str) -> list[dict]:
    return [e for e in ledger if span[0] <= e["start"] <= span[1] and data_flow(e["op"]) == flow]


def _freed(outcome: RunOutcome) -> list[str]:
    """Nothing autograd saves in forward has a whole weight's size, and nothing the forward made that is still
    alive after it (kept on ctx as an attribute, on the module, ...) is as large as a whole weight; forward
    all-gathers, and backward all-gathers again, at least once per layer."""
    problem = _problem(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        weights = outcome.inputs[case][0][0]
        whole = {prefix: list(weights[f"{prefix}.weight"].shape) for prefix in LAYER_NAMES}
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_label(outcome, case)}"
            for shape in result.output["saved"]:
                for prefix, full in whole.items():
                    if _numel(shape) == _numel(full):
                        return [f"{where}: during forward autograd saved a tensor of shape {shape} for backward, "
                                f"{floats(4 * _numel(shape))}: the size of {LAYER_NAMES[prefix]}'s whole weight "
                                f"{full}. ZeRO-3 frees the gathered weight after forward: save only the input and "
                                "the shards, and gather the weight again in backward (an F.linear on a gathered "
                                "weight saves that weight for its own backward)"]
            kept = _kept(result.output["kept"], whole)
            if kept:
                return [f"{where}: {kept}"]
            layers = len(whole)
            if len(_in(result.ledger, result.output["forward"], "all_gather")) < layers:
                return [f"{where}: forward all-gathered {len(_in(result.ledger, result.output['forward'], 'all_gather'))}"
                        f" times, expected at least once per layer ({layers}): each layer computes with its whole "
                        "weight, gathered from every rank's rows"]
            again = len(_in(result.ledger, result.output["backward"], "all_gather"))
            if again < layers:
                return [f"{where}: backward all-gathered {again} times, expected at least once per layer ({layers}): "
                        "a weight freed after forward must be gathered again for the input's gradient (grad_output "
                        "@ weight); if it was not, the whole weight was kept from forward to backward"]
    return []


def _kept(alive: list[int], whole: dict[str, list[int]]) -> str:
    """"" if no storage the forward made and left alive (`alive`, bytes) is as large as a layer's whole weight;
    else which one is, and why that is ZeRO-3's mistake."""
    by_size = sorted(whole.items(), key=lambda item: _numel(item[1]))
    for nbytes in alive:
        reached = [(prefix, full) for prefix, full in by_size if nbytes >= 4 * _numel(full)]
        if not reached:
            continue
        exact = [(prefix, full) for prefix, full in reached if nbytes == 4 * _numel(full)]
        prefix, full = exact[0] if exact else reached[-1]
        size = f"{'the' if exact else 'at least the'} size of {LAYER_NAMES[prefix]}'s whole weight {full}"
        return (f"after forward returned, a tensor it made, {floats(nbytes)}, is still alive: {size}. ZeRO-3 frees "
                "the gathered weight when forward returns; something still holds it (an attribute of ctx or of the "
                "module, a global, a list): keep only the input and the shards, and gather the weight again in "
                "backward")
    return ""


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _reduced(outcome: RunOutcome) -> list[str]:
    """Backward reduce-scatters at least once per layer; no all-reduce anywhere."""
    problem = _problem(outcome)
    if problem:
        return problem
    for case, rank, result in each_result(outcome):
        where = f"rank {rank}, {_label(outcome, case)}"
        reduced = [e for e in result.ledger if data_flow(e["op"]) == "all_reduce"]
        if reduced:
            return [f"{where}: all_reduce of {floats(reduced[0]['bytes'])}: every rank receives the whole "
                    "gradient and keeps only its rows of it; a reduce-scatter gives each rank only its rows, "
                    "with half the traffic (a ring all-reduce is a reduce-scatter, then an all-gather)"]
        scattered = len(_in(result.ledger, result.output["backward"], "reduce_scatter"))
        if scattered < len(LAYER_NAMES):
            return [f"{where}: backward reduce-scattered {scattered} times, expected at least once per layer "
                    f"({len(LAYER_NAMES)}): each rank's rows of the gradient are reduced over the ranks"]
    return []


def _items(n: int) -> tuple[Item, ...]:
    return (Item(f"outputs and the shards' gradients equal one process ({n} ranks)", 1, _values),
            Item(f"the shards after {STEPS} SGD steps equal one process ({n} ranks)", 1, _stepped),
            Item(f"forward frees the gathered weight, backward gathers it again ({n} ranks)", 1, _freed),
            Item(f"gradients reduce-scattered, no all-reduce ({n} ranks)", 1, _reduced))


ZERO3_LINEAR = Exercise(
    id="05.zero3_linear",
    hints=HINTS,
    function="ShardedLinear",
    signature="ShardedLinear(linear: torch.nn.Linear) -> torch.nn.Module",
    driver="zero3_linear",
    # all_reduce: allowed so that an answer using it gets the judges' words (the last item), not a refusal.
    allowed_ops=ZERO3_OPS,
    preload=FSDP2_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_case(n, 53, 3, 153)], _items(2), timeout_s=10),
        RunSpec(4, lambda n: [_case(n, 54, 2, 154)], _items(4), timeout_s=10),
    ),
)
