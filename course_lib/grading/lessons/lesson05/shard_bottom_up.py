"""05.shard_bottom_up: `fully_shard` each Block, then the root, over a 1-D mesh of all ranks.

Judged: the FSDP modules and every parameter's placements; one SGD step against one process on the whole
batch; the forward's all-gathers in the ledger (one per Block and the root's, each its group's padded
shards). The usual mistakes are named: only the root sharded, the root sharded first, a mesh of another size.
"""

from __future__ import annotations

from ....vocabulary import data_flow
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (FSDP2_OPS, FSDP2_PRELOAD, LR, TOY_2, TOY_3, all_gather_elements, batch, expected_placements,
                     floats, rows_text, rows_wrong, sgd_reference, toy, toy_weights)

__all__ = ["SHARD_BOTTOM_UP", "group_elements"]

HINTS = (
    "Reread lesson 05, section 3 '`fully_shard` on 2 ranks, bottom-up' and the contract's rule 2.",
    "torch.distributed.device_mesh.init_device_mesh (on the model's device type, of every rank) and "
    "torch.distributed.fsdp.fully_shard(module, mesh=...).",
    "One mesh of every rank; make each Block an FSDP module of its own before the whole model, so that each "
    "Block's parameters form their own group and the root's group gets only what no Block took.",
)

def _train_case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    weights = toy_weights(sizes, weights_seed)
    inputs, targets = batch(n * rows, sizes["dim"], sizes["out"], batch_seed)
    return {r: (sizes, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR)
            for r in range(n)}


def _shard_label(outcome: RunOutcome, case: int) -> str:
    sizes, _, inputs, _, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} (ToyModel with {sizes['layers']} Blocks, "
            f"{rows_text(inputs.shape[0])} per rank)")


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
                wrong = expected_placements(described, outcome.nproc)
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
        expected = sgd_reference(toy(sizes, weights), [(inputs, targets)], lr)
        for rank, result in sorted(by_rank.items()):
            for name, full in expected.items():
                wrong = rows_wrong(result.output["shards"][name], full, rank, outcome.nproc, name)
                if wrong:
                    return [f"rank {rank}, {_shard_label(outcome, case)}: after the step {wrong}"]
    return []


def group_elements(sizes: dict, weights: dict, n: int) -> tuple[int, int]:
    """(elements a rank all-gathers for one Block, for the root: the head), padded as FSDP2 pads."""
    block = [list(v.shape) for k, v in weights.items() if k.startswith("blocks.0.")]
    head = [list(v.shape) for k, v in weights.items() if k.startswith("head.")]
    return all_gather_elements(block, n), all_gather_elements(head, n)


def _forward_gathers(outcome: RunOutcome) -> list[str]:
    """The ledger: the forward all-gathers once per Block and once for the root, each its group's shards."""
    for case, by_rank in enumerate(outcome.results):
        sizes, weights = outcome.inputs[case][0][:2]
        block, root = group_elements(sizes, weights, outcome.nproc)
        expected = sorted([4 * root] + [4 * block] * sizes["layers"])  # float32
        for rank, result in sorted(by_rank.items()):
            start, stop = result.output["forward"]
            got = [e["bytes"] for e in result.ledger
                   if start <= e["start"] <= stop and data_flow(e["op"]) == "all_gather"]
            if sorted(got) == expected:
                continue
            where = f"rank {rank}, {_shard_label(outcome, case)}"
            should = (f"expected {len(expected)}: one per Block ({floats(4 * block)} each, its shards) and the "
                      f"root's ({floats(4 * root)}, the head's)")
            if not got:
                return [f"{where}: no all-gather in the forward, {should}: no parameter is sharded"]
            if got == [sum(expected)]:
                return [f"{where}: the forward all-gathers once, {floats(got[0])}: every parameter's shard at "
                        f"once, {should}. Only the root was sharded, so its group holds the whole model and the "
                        "forward gathers all of it before it starts; with each Block sharded first, each Block is "
                        "gathered just before it runs (and freed after)"]
            return [f"{where}: the forward all-gathers {len(got)} times "
                    f"({', '.join(floats(b) for b in got)}), {should}"]
    return []


SHARD_BOTTOM_UP = Exercise(
    id="05.shard_bottom_up",
    hints=HINTS,
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
