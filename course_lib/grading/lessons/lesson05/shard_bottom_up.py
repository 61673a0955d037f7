"""05.shard_bottom_up: `fully_shard` bottom up on a model whose Blocks are nested and whose embedding and head
share one weight: a group per Block, one group for the tied pair, the root last.

Judged: the FSDP modules, which of them form one group, the tie kept, every parameter's placements; one SGD
step against one process on the whole batch; the forward's all-gathers in the ledger (one per group, each its
group's padded shards). The usual mistakes are named: the stages sharded instead of their Blocks, the tied pair
left to the root, embed or head sharded alone (torch refuses), the root sharded first.
"""

from __future__ import annotations

from ....vocabulary import data_flow
from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (FSDP2_OPS, FSDP2_PRELOAD, LR, all_gather_elements, expected_placements, floats, rows_text,
                     rows_wrong, sgd_reference, weights_of)

__all__ = ["SHARD_BOTTOM_UP", "TIED_2", "TIED_4", "group_elements", "tied_units"]

HINTS = (
    "Reread lesson 05, section 3 '`fully_shard` on 2 ranks, bottom-up' and the contract's rule 2; then "
    "fully_shard's docstring on shared parameters.",
    "torch.distributed.fsdp.fully_shard(module_or_list_of_modules, mesh=...); init_device_mesh; "
    "model.modules() and isinstance with course_lib.models.Block.",
    "Find every Block wherever it sits and make it a group; the embedding and the head hold one Parameter, so "
    "one call must take both into one group; the root last, holding what is left (the norm).",
)

TIED_2 = {"vocab": 11, "dim": 8, "hidden": 13, "stages": [2, 1]}  # 3 Blocks in 2 stages
TIED_4 = {"vocab": 6, "dim": 8, "hidden": 13, "stages": [1, 1, 2]}  # on 4 ranks the tied weight's 6 rows: 2, 2, 2, 0


def tied_units(sizes: dict) -> list[str]:
    """The modules fully_shard must have made FSDP modules, in module order: the root, embed, every Block, head."""
    blocks = [f"stages.{s}.{b}" for s, count in enumerate(sizes["stages"]) for b in range(count)]
    return ["", "embed", *blocks, "head"]


def _model(sizes: dict, weights: dict | None = None):
    from .drivers import tied_model

    model = tied_model(sizes)
    if weights is not None:
        model.load_state_dict(weights)
    return model


def _train_case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    import torch

    weights = weights_of(lambda: _model(sizes), weights_seed)
    generator = torch.Generator().manual_seed(batch_seed)
    tokens = torch.randint(0, sizes["vocab"], (n * rows,), generator=generator)
    targets = torch.randn(n * rows, sizes["vocab"], generator=generator)
    return {r: (sizes, weights, tokens[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR)
            for r in range(n)}


def _shard_label(outcome: RunOutcome, case: int) -> str:
    sizes, _, inputs, _, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} (stages of {', '.join(map(str, sizes['stages']))} Blocks, "
            f"vocab {sizes['vocab']}, {rows_text(inputs.shape[0])} per rank)")


def _shown(names: list[str]) -> str:
    return "[" + ", ".join(repr(name) for name in names) + "]"


def _units_hint(got: list[str], groups: list[list[str]], expected: list[str]) -> str:
    missing = [name for name in expected if name not in got]
    extra = [name for name in got if name not in expected]
    stages = [name for name in extra if name.count(".") == 1 and name.startswith("stages.")]
    if got == [""]:
        return "only the root is: one group holds the whole model, gathered whole before the forward"
    if stages:
        return (f"{stages[0]} is a Sequential of Blocks: a group per stage gathers all its Blocks at once; make each "
                "Block (course_lib.models.Block, found with model.modules()) a group of its own")
    if "embed" in missing and "head" in missing:
        return ("embed and head are not: the tied pair stayed in the root's group, gathered from the first layer "
                "to the last; one fully_shard call given both modules makes them one group of their own")
    if "" in missing:
        return "the root is not: call fully_shard(model) last"
    if missing:
        return f"{missing[0]} is not: every Block must be a group of its own"
    return f"{extra[0]} is too: shard only the Blocks, the tied pair and the root"


def _sharded(outcome: RunOutcome) -> list[str]:
    """The FSDP modules are the root, embed, every Block and head; embed and head are one group, the others one
    each; the tie survives; every parameter is a DTensor (Shard(0),) on a 1-D CPU mesh of all ranks."""
    for case, rank, result in each_result(outcome):
        sizes = outcome.inputs[case][0][0]
        expected = tied_units(sizes)
        where = f"rank {rank}, {_shard_label(outcome, case)}"
        got, groups = result.output["units"], result.output["groups"]
        if got != expected:
            return [f"{where}: the FSDP modules are {_shown(got)}, expected {_shown(expected)}: "
                    f"{_units_hint(got, groups, expected)}"]
        pair = next((g for g in groups if "embed" in g), [])
        if sorted(pair) != ["embed", "head"]:
            return [f"{where}: embed's group is {_shown(pair)}, expected ['embed', 'head']: the two modules that share "
                    "the weight must be one group (one fully_shard call given both), gathered once"]
        if not result.output["tied"]:
            return [f"{where}: head.weight is no longer embed.weight after sharding: the tie is broken, so the two "
                    "would train apart"]
        for name, described in result.output["params"].items():
            wrong = expected_placements(described, outcome.nproc)
            if wrong:
                return [f"{where}: {name} {wrong}"]
    return []


def _trained(outcome: RunOutcome) -> list[str]:
    """After one SGD step every rank's rows of every parameter equal one process's step on the whole batch."""
    import torch

    for case in range(len(outcome.results)):
        sizes, weights, _, _, lr = outcome.inputs[case][0]
        inputs = torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)])
        targets = torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)])
        expected = sgd_reference(_model(sizes, weights), [(inputs, targets)], lr)
        for rank in sorted(outcome.results[case]):
            shards = outcome.results[case][rank].output["shards"]
            for name, full in expected.items():
                wrong = rows_wrong(shards[name], full, rank, outcome.nproc, name)
                if wrong:
                    return [f"rank {rank}, {_shard_label(outcome, case)}: after the step {wrong}"]
    return []


def group_elements(sizes: dict, weights: dict, n: int) -> tuple[int, int, int]:
    """(elements a rank all-gathers for one Block, for the tied pair, for the root: the norm), padded as FSDP2
    pads (the tied weight counted once)."""
    block = [list(v.shape) for k, v in weights.items() if k.startswith("stages.0.0.")]
    pair = [list(weights["embed.weight"].shape)]
    root = [list(v.shape) for k, v in weights.items() if k.startswith("norm.")]
    return all_gather_elements(block, n), all_gather_elements(pair, n), all_gather_elements(root, n)


def _forward_gathers(outcome: RunOutcome) -> list[str]:
    """The ledger: the forward all-gathers once per group, each its group's shards."""
    for case, rank, result in each_result(outcome):
        sizes, weights = outcome.inputs[case][0][:2]
        block, pair, root = group_elements(sizes, weights, outcome.nproc)
        blocks = sum(sizes["stages"])
        expected = sorted([4 * root, 4 * pair] + [4 * block] * blocks)  # float32
        start, stop = result.output["forward"]
        got = [e["bytes"] for e in result.ledger if start <= e["start"] <= stop and data_flow(e["op"]) == "all_gather"]
        if sorted(got) == expected:
            continue
        where = f"rank {rank}, {_shard_label(outcome, case)}"
        should = (f"expected {len(expected)}: one per Block ({floats(4 * block)} each), the tied pair's "
                  f"({floats(4 * pair)}, its one weight) and the root's ({floats(4 * root)}, the norm)")
        if not got:
            return [f"{where}: no all-gather in the forward, {should}: no parameter is sharded"]
        return [f"{where}: the forward all-gathers {len(got)} times ({', '.join(floats(b) for b in got)}), {should}"]
    return []


SHARD_BOTTOM_UP = Exercise(
    id="05.shard_bottom_up",
    hints=HINTS,
    function="shard_bottom_up",
    signature="shard_bottom_up(model: torch.nn.Module) -> None",
    driver="fsdp2_shard",
    allowed_ops=FSDP2_OPS,
    preload=FSDP2_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_train_case(n, TIED_2, 51, 2, 151)],
                (Item("the groups: each Block, embed and head together, the root; every parameter Shard(0) on all "
                      "2 ranks", 1, _sharded),
                 Item("one SGD step equals one process on the whole batch (2 ranks)", 1, _trained),
                 Item("the forward all-gathers once per group (2 ranks)", 1, _forward_gathers)), timeout_s=10),
        RunSpec(4, lambda n: [_train_case(n, TIED_4, 52, 1, 152)],
                (Item("the groups: each Block, embed and head together, the root; every parameter Shard(0) on all "
                      "4 ranks", 1, _sharded),
                 Item("one SGD step equals one process on the whole batch (4 ranks)", 1, _trained),
                 Item("the forward all-gathers once per group (4 ranks)", 1, _forward_gathers)), timeout_s=10),
    ),
)
