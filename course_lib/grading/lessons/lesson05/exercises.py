"""Lesson 05's exercises: FSDP2's `fully_shard` bottom up, ZeRO-3 by hand for one Linear, gradient
accumulation without reduce-scatters, and a model built on the meta device and filled from rank 0.

Every run shards over a 1-D mesh of all ranks on the CPU (gloo). The models are
`course_lib.models.ToyModel` (Blocks and a head) and one `nn.Linear`, weights
drawn here, in the checker's process, from a fixed seed. The references are one
process, computed here without torch.distributed: SGD on the whole batch, the
gradient of the whole batch, the model drawn from the seed; each rank's part is
its dim-0 rows, as FSDP2 cuts them (`shard_rows`). The ledger says what each
rank sent: the forward's all-gathers (one per Block and the root's), the
backward's reduce-scatters, in which micro-batch. Judges name the rank, the
case and the first wrong value, and recognise the usual mistakes (only the root
sharded, the root sharded first, a mesh of another size, all-reduce for
reduce-scatter, a sum for an average, the parameter gathered into the shard,
sync left off or turned off on the root only, the loss divided by the wrong
number, `reset_parameters` on the shards, no `broadcast_from_rank0`).
"""

from __future__ import annotations

import math

from ....theory import chunk_sizes, fsdp2_padded_shard_numel
from ....vocabulary import data_flow
from ...compare import first_difference
from ..lesson04.exercises import ATOL, LR, RTOL, _batch, _weights, sgd_reference
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["ATOL", "EXERCISES", "FSDP2_OPS", "LR", "RTOL", "all_gather_elements", "shard_rows"]

# What fully_shard calls: on CPU with torch 2.13 and 2.15 the *_single forms; elsewhere their older spellings.
FSDP2_OPS = frozenset({"all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single"})
# fully_shard, DTensor and DeviceMesh (about 0.8 s a process), and torch._dynamo, which the first fully_shard
# imports (2.4 s for 2 ranks at once on 2 cores, 215 modules).
FSDP2_PRELOAD = ("torch._dynamo", "torch.distributed.fsdp")
TOY_2 = {"dim": 8, "hidden": 13, "layers": 2, "out": 5}  # ToyModel's defaults: 503 parameters
TOY_3 = {"dim": 8, "hidden": 13, "layers": 3, "out": 5}  # on 4 ranks: the head's 5 rows are 2, 2, 1 and 0


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows FSDP2 gives `rank` of a parameter with `rows` rows: torch.chunk's
    pieces, ceil(rows / world_size) each, the last ones shorter or empty (theory.chunk_sizes)."""
    sizes = chunk_sizes(rows, world_size)
    start = min(rank * sizes[0], rows)
    return start, start + sizes[rank]


def all_gather_elements(shapes: list, world_size: int) -> int:
    """Elements one rank hands to a group's all-gather: each parameter's shard padded to ceil(rows / N) rows
    (theory.fsdp2_padded_shard_numel)."""
    return sum(fsdp2_padded_shard_numel(tuple(shape), world_size) for shape in shapes)


def _rows(count: int) -> str:
    return f"{count} row{'s' * (count != 1)}"


def _floats(nbytes: int) -> str:
    """A float32 tensor's bytes, and its elements: "476 B = 119 floats"."""
    return f"{nbytes} B = {nbytes // 4} floats"


def _toy(sizes: dict, weights: dict):
    from .drivers import toy_from_weights

    return toy_from_weights(sizes, weights)


def _toy_weights(sizes: dict, seed: int) -> dict:
    from ....models import ToyModel

    return _weights(lambda: ToyModel(**sizes), seed)


def _rows_wrong(got, full, rank: int, n: int, name: str) -> str:
    """"" if `got` equals `rank`'s rows of `full`; else which rows of `name` differ, and how."""
    start, stop = shard_rows(full.shape[0], n, rank)
    wrong = first_difference(got, full[start:stop], rtol=RTOL, atol=ATOL)
    if not wrong:
        return ""
    rows = f"rows {start} to {stop - 1}" if stop > start else "no rows (an empty shard)"
    return f"its shard of {name} ({rows} of {full.shape[0]}) {wrong}"


def _expected_placements(described: dict, n: int) -> str:
    """What is wrong with one parameter's description (drivers._placements), "" if it is a DTensor
    sharded on dim 0 over a 1-D CPU mesh of all `n` ranks."""
    if described["type"] != "DTensor":
        return f"is a {described['type']} on {described['device']}, not a DTensor: fully_shard did not shard it"
    if described["placements"] != ["Shard(dim=0)"]:
        return (f"has placements ({', '.join(described['placements'])},), expected (Shard(dim=0),) on a 1-D mesh "
                "(a 2-D mesh replicates over its first dimension: HSDP)")
    if described["mesh_ranks"] != list(range(n)):
        return f"is sharded over ranks {described['mesh_ranks']}, expected all {n} ranks {list(range(n))}"
    if described["device"] != "cpu":
        return f"is on the {described['device']} device, expected the CPU"
    return ""


# ---------------------------------------------------------------- 05.shard_bottom_up


def _train_case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    weights = _toy_weights(sizes, weights_seed)
    inputs, targets = _batch(n * rows, sizes["dim"], sizes["out"], batch_seed)
    return {r: (sizes, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR)
            for r in range(n)}


def _shard_label(outcome: RunOutcome, case: int) -> str:
    sizes, _, inputs, _, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} (ToyModel with {sizes['layers']} Blocks, "
            f"{_rows(inputs.shape[0])} per rank)")


def _units(sizes: dict) -> list[str]:
    """The modules fully_shard must have made FSDP modules: the root ("") and every Block, in module order."""
    return [""] + [f"blocks.{i}" for i in range(sizes["layers"])]


def _shown(names: list[str]) -> str:
    return "[" + ", ".join(repr(name) for name in names) + "]"


def _sharded(outcome: RunOutcome) -> list[str]:
    """Every Block and the root are FSDP modules, nothing else is; every parameter is a DTensor with
    placements (Shard(0),) on a 1-D CPU mesh of all ranks."""
    for case, by_rank in enumerate(outcome.results):
        sizes = outcome.inputs[case][0][0]
        expected = _units(sizes)
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_shard_label(outcome, case)}"
            got = result.output["units"]
            if got != expected:
                missing = [name for name in expected if name not in got]
                extra = [name for name in got if name not in expected]
                if got == [""]:
                    hint = ("only the root is: fully_shard(model) alone puts every parameter in one group, gathered "
                            "whole before the forward; call fully_shard on each Block first")
                elif "" in missing:
                    hint = "the root is not: call fully_shard(model) last, after the Blocks"
                elif missing:
                    hint = f"{missing[0]} is not: call fully_shard on every Block (model.blocks)"
                else:
                    hint = f"{extra[0]} is too: shard only the Blocks and the root"
                return [f"{where}: the FSDP modules are {_shown(got)}, expected {_shown(expected)}: {hint}"]
            for name, described in result.output["params"].items():
                wrong = _expected_placements(described, outcome.nproc)
                if wrong:
                    return [f"{where}: {name} {wrong}"]
    return []


def _trained(outcome: RunOutcome) -> list[str]:
    """After one SGD step every rank's rows of every parameter equal one process's step on the whole batch."""
    import torch

    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, _, lr = outcome.inputs[case][0]
        inputs = torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)])
        targets = torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)])
        expected = sgd_reference(_toy(sizes, weights), [(inputs, targets)], lr)
        for rank, result in sorted(by_rank.items()):
            for name, full in expected.items():
                wrong = _rows_wrong(result.output["shards"][name], full, rank, outcome.nproc, name)
                if wrong:
                    return [f"rank {rank}, {_shard_label(outcome, case)}: after the step {wrong}"]
    return []


def _group_elements(sizes: dict, weights: dict, n: int) -> tuple[int, int]:
    """(elements a rank all-gathers for one Block, for the root: the head), padded as FSDP2 pads."""
    block = [list(v.shape) for k, v in weights.items() if k.startswith("blocks.0.")]
    head = [list(v.shape) for k, v in weights.items() if k.startswith("head.")]
    return all_gather_elements(block, n), all_gather_elements(head, n)


def _forward_gathers(outcome: RunOutcome) -> list[str]:
    """The ledger: the forward all-gathers once per Block and once for the root, each its group's shards."""
    for case, by_rank in enumerate(outcome.results):
        sizes, weights = outcome.inputs[case][0][:2]
        block, root = _group_elements(sizes, weights, outcome.nproc)
        expected = sorted([4 * root] + [4 * block] * sizes["layers"])  # float32
        for rank, result in sorted(by_rank.items()):
            start, stop = result.output["forward"]
            got = [e["bytes"] for e in result.ledger
                   if start <= e["start"] <= stop and data_flow(e["op"]) == "all_gather"]
            if sorted(got) == expected:
                continue
            where = f"rank {rank}, {_shard_label(outcome, case)}"
            should = (f"expected {len(expected)}: one per Block ({_floats(4 * block)} each, its shards) and the "
                      f"root's ({_floats(4 * root)}, the head's)")
            if not got:
                return [f"{where}: no all-gather in the forward, {should}: no parameter is sharded"]
            if got == [sum(expected)]:
                return [f"{where}: the forward all-gathers once, {_floats(got[0])}: every parameter's shard at "
                        f"once, {should}. Only the root was sharded, so its group holds the whole model and the "
                        "forward gathers all of it before it starts; with each Block sharded first, each Block is "
                        "gathered just before it runs (and freed after)"]
            return [f"{where}: the forward all-gathers {len(got)} times "
                    f"({', '.join(_floats(b) for b in got)}), {should}"]
    return []


SHARD_BOTTOM_UP = Exercise(
    id="05.shard_bottom_up",
    function="shard_bottom_up",
    signature="shard_bottom_up(model: ToyModel) -> None",
    driver="fsdp2_shard",
    allowed_ops=FSDP2_OPS,
    preload=FSDP2_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_train_case(n, TOY_2, 51, 2, 151)],
                (Item("every Block and the root are FSDP modules, every parameter Shard(0) on all 2 ranks", 1,
                      _sharded),
                 Item("one SGD step equals one process on the whole batch (2 ranks)", 1, _trained),
                 Item("the forward all-gathers once per Block and once for the root (2 ranks)", 1,
                      _forward_gathers)), timeout_s=10),
        RunSpec(4, lambda n: [_train_case(n, TOY_3, 52, 1, 152)],
                (Item("every Block and the root are FSDP modules, every parameter Shard(0) on all 4 ranks", 1,
                      _sharded),
                 Item("one SGD step equals one process on the whole batch (4 ranks)", 1, _trained),
                 Item("the forward all-gathers once per Block and once for the root (4 ranks)", 1,
                      _forward_gathers)), timeout_s=10),
    ),
)


# ---------------------------------------------------------------- 05.zero3_linear


def _linear_case(n: int, features: int, out: int, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    import torch

    weights = _weights(lambda: torch.nn.Linear(features, out), weights_seed)
    inputs, targets = _batch(n * rows, features, out, batch_seed)
    return {r: (weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows]) for r in range(n)}


def linear_grads(weights: dict, inputs, targets) -> list:
    """[weight.grad, bias.grad] of nn.Linear holding `weights` after mse_loss on (inputs, targets): one process."""
    import torch

    out, features = weights["weight"].shape
    linear = torch.nn.Linear(features, out)
    linear.load_state_dict(weights)
    torch.nn.functional.mse_loss(linear(inputs), targets).backward()
    return [linear.weight.grad, linear.bias.grad]


def _linear_label(outcome: RunOutcome, case: int) -> str:
    weights, inputs, _ = outcome.inputs[case][0]
    out, features = weights["weight"].shape
    return (f"case {case + 1} of {len(outcome.inputs)} (Linear({features}, {out}), {_rows(inputs.shape[0])} of the "
            f"batch and {_rows(out // outcome.nproc)} of the weight per rank)")


def _zero3_grads(outcome: RunOutcome) -> list[str]:
    """Each rank's two gradients are its rows of one process's gradient on the whole batch, and equal
    fully_shard's gradient shards (the local tensors) on the same Linear."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights = outcome.inputs[case][0][0]
        inputs = torch.cat([outcome.inputs[case][r][1] for r in range(n)])
        targets = torch.cat([outcome.inputs[case][r][2] for r in range(n)])
        expected = linear_grads(weights, inputs, targets)
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_linear_label(outcome, case)}"
            got = result.output["grads"]
            if isinstance(got, str):
                return [f"{where}: zero3_linear returned a {got}, expected (weight_grad, bias_grad), this rank's rows"]
            own = linear_grads(weights, *outcome.inputs[case][rank][1:])
            for index, name in enumerate(("weight", "bias")):
                full = expected[index]
                start, stop = shard_rows(full.shape[0], n, rank)
                wrong = first_difference(got[index], full[start:stop], rtol=RTOL, atol=ATOL)
                if wrong:
                    hint = ""
                    if got[index].shape == full.shape:
                        hint = (f": that is the whole gradient, not this rank's rows {start} to {stop - 1}; "
                                "reduce-scatter it, so that each rank receives only its rows")
                    elif not first_difference(got[index], n * full[start:stop], rtol=1e-4, atol=ATOL):
                        hint = (f": that is {n} times the average, the sum over the ranks; average it "
                                "(op=dist.ReduceOp.AVG, or divide by the world size)")
                    elif not first_difference(got[index], own[index][start:stop], rtol=1e-4, atol=ATOL):
                        hint = (": that is this rank's own gradient, from its rows of the batch only: it was not "
                                "reduced over the ranks")
                    return [f"{where}: the {name} gradient (rows {start} to {stop - 1} of {full.shape[0]}) "
                            f"{wrong}{hint}"]
                fsdp = first_difference(result.output["fsdp"][index], full[start:stop], rtol=RTOL, atol=ATOL)
                if fsdp:
                    return [f"{where}: your {name} gradient equals one process's, but fully_shard's own shard on this "
                            f"rank {fsdp}: this torch's fully_shard does not average as one process does (gloo "
                            "summed instead of averaging in pytorch/pytorch#162338)"]
    return []


def _zero3_traffic(outcome: RunOutcome) -> list[str]:
    """The ledger of the function: all-gathers and reduce-scatters, no all-reduce; the shards it was given are
    still this rank's rows afterwards (the whole parameters lived only while it ran)."""
    for case, by_rank in enumerate(outcome.results):
        weights = outcome.inputs[case][0][0]
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_linear_label(outcome, case)}"
            start, stop = result.output["span"]
            flows = [(data_flow(e["op"]), e) for e in result.ledger if start <= e["start"] <= stop]
            reduced = [e for flow, e in flows if flow == "all_reduce"]
            if reduced:
                return [f"{where}: all_reduce of {_floats(reduced[0]['bytes'])}: every rank receives the whole "
                        "gradient and keeps only its rows of it; reduce-scatter (dist.reduce_scatter_tensor) gives "
                        "each rank only its rows, with half the traffic (a ring all-reduce is a reduce-scatter, then "
                        "an all-gather)"]
            if not any(flow == "all_gather" for flow, _ in flows):
                return [f"{where}: no all-gather: the forward needs the whole weight and bias, gathered from every "
                        "rank's rows"]
            if not any(flow == "reduce_scatter" for flow, _ in flows):
                return [f"{where}: no reduce-scatter: each rank's rows of the gradient must be reduced over the ranks"]
            for index, name in enumerate(("weight", "bias")):
                full = weights[name]
                begin, end = shard_rows(full.shape[0], outcome.nproc, rank)
                after = result.output["after"][index]
                if list(after.shape) != list(full[begin:end].shape):
                    return [f"{where}: after zero3_linear returns, {name}_shard holds {list(after.shape)}, not this "
                            f"rank's {list(full[begin:end].shape)}: the gathered {name} was kept in the shard. ZeRO-3 "
                            "keeps only the shard between uses: gather into a new tensor, freed when the function "
                            "returns"]
                if first_difference(after, full[begin:end]):
                    return [f"{where}: zero3_linear changed {name}_shard's values; leave the shard as given"]
    return []


ZERO3_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce"})

ZERO3_LINEAR = Exercise(
    id="05.zero3_linear",
    function="zero3_linear",
    signature=("zero3_linear(weight_shard: torch.Tensor, bias_shard: torch.Tensor, inputs: torch.Tensor, "
               "targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]"),
    driver="zero3_linear",
    # all_reduce: allowed so that an answer using it gets the judges' words (the ledger item), not a refusal.
    allowed_ops=ZERO3_OPS,
    preload=FSDP2_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_linear_case(n, 5, 6, 53, 3, 153)],
                (Item("each rank's gradient rows equal fully_shard's and one process's (2 ranks)", 1, _zero3_grads),
                 Item("all-gather, then reduce-scatter, no all-reduce; the shards stay shards (2 ranks)", 1,
                      _zero3_traffic)), timeout_s=10),
        RunSpec(4, lambda n: [_linear_case(n, 3, 8, 54, 2, 154)],
                (Item("each rank's gradient rows equal fully_shard's and one process's (4 ranks)", 1, _zero3_grads),
                 Item("all-gather, then reduce-scatter, no all-reduce; the shards stay shards (4 ranks)", 1,
                      _zero3_traffic)), timeout_s=10),
    ),
)


# ---------------------------------------------------------------- 05.accumulate


def _micro_case(n: int, sizes: dict, weights_seed: int, k: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    """Rank r gets K micro-batches of `rows` rows, its own part of one batch of n * k * rows."""
    weights = _toy_weights(sizes, weights_seed)
    inputs, targets = _batch(n * k * rows, sizes["dim"], sizes["out"], batch_seed)
    case = {}
    for r in range(n):
        starts = [(r * k + i) * rows for i in range(k)]
        case[r] = (sizes, weights, [(inputs[s:s + rows], targets[s:s + rows]) for s in starts], LR)
    return case


def _micro_label(outcome: RunOutcome, case: int) -> str:
    sizes, _, micro_batches, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} (ToyModel with {sizes['layers']} Blocks, "
            f"K={len(micro_batches)} micro-batches of {_rows(micro_batches[0][0].shape[0])} per rank)")


def _accumulated(outcome: RunOutcome) -> list[str]:
    """Every rank's rows of every parameter equal one process's SGD step on all micro-batches of all ranks."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, lr = outcome.inputs[case][0]
        k = len(outcome.inputs[case][0][2])
        pairs = [pair for r in range(n) for pair in outcome.inputs[case][r][2]]
        inputs, targets = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        expected = sgd_reference(_toy(sizes, weights), [(inputs, targets)], lr)
        for rank, result in sorted(by_rank.items()):
            for name, full in expected.items():
                got = result.output["shards"][name]
                wrong = _rows_wrong(got, full, rank, n, name)
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


# ---------------------------------------------------------------- 05.meta_init_broadcast


def _meta_case(n: int, sizes: dict, weights_seed: int, seed: int) -> dict[int, tuple]:
    """Rank 0 gets the full state dict drawn from `weights_seed`, the others {}; every rank the same `seed`."""
    weights = _toy_weights(sizes, weights_seed)
    return {r: (sizes, weights if r == 0 else {}, seed) for r in range(n)}


def _meta_label(outcome: RunOutcome, case: int) -> str:
    sizes = outcome.inputs[case][0][0]
    return f"case {case + 1} of {len(outcome.inputs)} (ToyModel with {sizes['layers']} Blocks)"


def _built_on_meta(outcome: RunOutcome) -> list[str]:
    """build() ran once, on the meta device; the returned model's parameters are DTensors Shard(0) over all
    ranks, on the CPU (to_empty gave them memory)."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_meta_label(outcome, case)}"
            built = result.output["built_on"]
            if built != ["meta"]:
                if not built:
                    return [f"{where}: build() was not called: build the model with it, under torch.device('meta')"]
                if built[0] != "meta":
                    return [f"{where}: build() made the parameters on the {built[0]} device, so every rank held and "
                            "initialised the whole model; call it inside `with torch.device('meta'):`"]
                return [f"{where}: build() was called {len(built)} times, expected once"]
            if "returned" in result.output:
                return [f"{where}: the function returned a {result.output['returned']}, expected the sharded model"]
            for name, described in result.output["params"].items():
                if described["device"] == "meta":
                    return [f"{where}: {name} is still on the meta device (no memory): call "
                            "model.to_empty(device='cpu') after fully_shard"]
                wrong = _expected_placements(described, outcome.nproc)
                if wrong:
                    return [f"{where}: {name} {wrong}"]
    return []


def _same_on_every_rank(by_rank: dict, name: str) -> bool:
    """Whether every rank's shard of `name` starts with the same values (as far as the shortest, non-empty, goes):
    what ranks that drew their shards from one random state hold."""
    import torch

    shards = [result.output["shards"][name].flatten() for result in by_rank.values() if "shards" in result.output]
    shards = [s for s in shards if s.numel()]
    length = min((s.numel() for s in shards), default=0)
    return len(shards) > 1 and all(torch.equal(s[:length], shards[0][:length]) for s in shards[1:])


def _loaded_from_rank_0(outcome: RunOutcome) -> list[str]:
    """Every rank's rows of every parameter equal the same rows of the model rank 0's state dict holds (one
    process, drawn from the seed)."""
    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _ = outcome.inputs[case][0]
        expected = dict(_toy(sizes, weights).named_parameters())
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_meta_label(outcome, case)}"
            if "shards" not in result.output:
                return [f"{where}: the function returned a {result.output['returned']}, expected the sharded model"]
            for name, full in expected.items():
                wrong = _rows_wrong(result.output["shards"][name], full.detach(), rank, outcome.nproc, name)
                if not wrong:
                    continue
                hint = ""
                if _same_on_every_rank(by_rank, name):
                    hint = (f": every rank's shard of {name} starts with the same values. reset_parameters() on a "
                            "sharded model draws each rank's rows from the same random state, so the ranks hold "
                            "copies of one shard, not the rows of the one-process model; load rank 0's state dict "
                            "instead")
                return [f"{where}: {wrong}{hint}"]
    return []


META_OPS = FSDP2_OPS | {"broadcast", "broadcast_object_list", "scatter"}

META_INIT = Exercise(
    id="05.meta_init_broadcast",
    function="init_sharded",
    signature="init_sharded(build: Callable[[], ToyModel], full_state: dict) -> FSDPModule",
    driver="fsdp2_meta_init",
    # broadcast and broadcast_object_list: what broadcast_from_rank0 calls. scatter: what loading a full state
    # dict without it calls on rank 0 (distribute_tensor), allowed so that such an answer gets torch's words.
    allowed_ops=META_OPS,
    preload=FSDP2_PRELOAD + ("torch.distributed.checkpoint.state_dict",),
    runs=(
        RunSpec(2, lambda n: [_meta_case(n, TOY_2, 57, 157)],
                (Item("built on the meta device, every parameter Shard(0) on the CPU (2 ranks)", 1, _built_on_meta),
                 Item("every rank's rows equal rank 0's state dict (2 ranks)", 1, _loaded_from_rank_0)),
                timeout_s=10),
        RunSpec(4, lambda n: [_meta_case(n, TOY_3, 58, 158)],
                (Item("built on the meta device, every parameter Shard(0) on the CPU (4 ranks)", 1, _built_on_meta),
                 Item("every rank's rows equal rank 0's state dict (4 ranks)", 1, _loaded_from_rank_0)),
                timeout_s=10),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (SHARD_BOTTOM_UP, ZERO3_LINEAR, ACCUMULATE, META_INIT)}
