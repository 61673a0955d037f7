"""04.full_state_dict: a full state dict that only rank 0 can read, loaded into a sharded model of another wrapping
(every rank's shards from rank 0's tensors, sent by dist.broadcast)."""

from __future__ import annotations

from ...compare import each_result, first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import ATOL, FSDP1_OPS, FSDP_PRELOAD, RTOL, TOY, draw_weights

__all__ = ["FULL_STATE_DICT"]

_WRAPS = {"linears": "one unit per Linear", "root": "the root the only unit"}


def _load_case(n: int, weights_seed: int, checkpoint_seed: int, policy: str, index: int) -> dict[int, tuple]:
    from ....models import ToyModel

    weights = draw_weights(lambda: ToyModel(**TOY), weights_seed)
    checkpoint = draw_weights(lambda: ToyModel(**TOY), checkpoint_seed)
    return {r: (TOY, weights, policy, checkpoint, f"model_case{index}.pt") for r in range(n)}


def _label(outcome: RunOutcome, case: int) -> str:
    return f"case {case + 1} of {len(outcome.inputs)} (ToyModel, {_WRAPS[outcome.inputs[case][0][2]]})"


def _wrong_piece(result, inputs: tuple, rank: int) -> str:
    """The first parameter piece this rank holds that is not the checkpoint's, in words ("" if none)."""
    _, weights, _, checkpoint, _ = inputs
    pieces = result.output.get("pieces")
    if not pieces:
        return "this rank's shards hold no piece of any parameter"
    for name, want in checkpoint.items():
        if name not in pieces:
            continue  # a parameter none of this rank's shards holds (the whole of it padding-free on another rank)
        first, values = pieces[name]["first"], pieces[name]["values"]
        expected = want.flatten()[first:first + values.numel()]
        wrong = first_difference(values, expected, rtol=RTOL, atol=ATOL)
        if not wrong:
            continue
        where = f"its shard of {name} (elements {first} to {first + values.numel() - 1} of the flattened tensor)"
        before = weights[name].flatten()[first:first + values.numel()]
        if not first_difference(values, before, rtol=RTOL, atol=ATOL):
            if rank == 0:
                return (f"{where} still holds the model's values from before the load: rank 0 read the file, but "
                        "the state dict's tensors are copies (FSDP1 clones what it gathers); the model changes only "
                        "by model.load_state_dict(...)")
            return (f"{where} still holds the model's values from before the load, not the file's: rank 0 alone can "
                    "read the file, so each tensor must come from rank 0 (dist.broadcast), and every rank must load "
                    "what arrived")
        return f"{where} {wrong}"
    return ""


def _judge(ranks) -> callable:
    def judge(outcome: RunOutcome) -> list[str]:
        for case, rank, result in each_result(outcome):
            if not ranks(rank):
                continue
            wrong = _wrong_piece(result, outcome.inputs[case][rank], rank)
            if wrong:
                return [f"rank {rank}, {_label(outcome, case)}: {wrong}"]
        return []
    return judge


_rank_0 = _judge(lambda rank: rank == 0)
_rank_0.__doc__ = "Rank 0's shards (the rank that reads the file) hold the file's values."
_others = _judge(lambda rank: rank != 0)
_others.__doc__ = "Every other rank's shards hold the file's values: what rank 0 read reached them."


FULL_STATE_DICT = Exercise(
    id="04.full_state_dict",
    function="load_full_state_dict",
    signature="load_full_state_dict(model: FullyShardedDataParallel, path: str) -> None",
    driver="fsdp_load",
    allowed_ops=FSDP1_OPS | {"broadcast"},
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_load_case(n, 48, 46, "linears", 1)],
                (Item("rank 0's shards hold the file's values (2 ranks, one unit per Linear)", 1, _rank_0),
                 Item("rank 1's shards hold the file's values (2 ranks, one unit per Linear)", 1, _others)),
                timeout_s=10),
        RunSpec(3, lambda n: [_load_case(n, 49, 47, "root", 1)],
                (Item("rank 0's shards hold the file's values (3 ranks, the root only)", 1, _rank_0),
                 Item("ranks 1 and 2's shards hold the file's values (3 ranks, the root only)", 1, _others)),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 9 'State dicts: the checkpoints you save' (what a FULL state dict holds, who "
        "calls state_dict() and load_state_dict(), and what the lesson's reload did that you cannot do here).",
        "FullyShardedDataParallel.state_dict_type with StateDictType.FULL_STATE_DICT; dist.broadcast(tensor, src=0); "
        "load_state_dict.",
        "Only rank 0 can read the file, but every rank must call the same collectives on tensors of the same "
        "shapes: the model itself tells every rank its names and shapes; fill them on rank 0, send each tensor, "
        "and load what arrived on every rank.",
    ),
)
