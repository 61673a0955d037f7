"""04.flat_shard_numel: each rank's piece of a FlatParameter and its padding, against what FSDP1 built."""

from __future__ import annotations

import math

from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import FSDP_PRELOAD

__all__ = ["FLAT_SHARD", "flat_shard"]

def flat_shard(param_numels: list[int], world_size: int) -> tuple[int, int]:
    """(elements in each rank's shard, padding) of one FlatParameter of FULL_SHARD, use_orig_params=False:
    the parameters flattened one after the other (no alignment padding), padded at the end to a multiple
    of the world size."""
    total = sum(param_numels)
    shard = -(-total // world_size)
    return shard, shard * world_size - total


def _shape_cases(n: int, specs: list[list[tuple]]) -> list[dict[int, tuple]]:
    return [{r: ([list(shape) for shape in shapes],) for r in range(n)} for shapes in specs]


def _numels(outcome: RunOutcome, case: int) -> list[int]:
    return [math.prod(shape) for shape in outcome.inputs[case][0][0]]


def _shard_label(outcome: RunOutcome, case: int) -> str:
    numels = _numels(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} (param_numels={numels}, {sum(numels)} elements, "
            f"world_size={outcome.nproc})")


def _real(outcome: RunOutcome, case: int) -> tuple[dict[int, int], int]:
    """({rank: elements its shard holds}, the FlatParameter's padding), as FSDP built them. The padding is
    summed over the ranks: it sits on the last rank unless it is longer than a shard (5 elements on 4 ranks)."""
    by_rank = outcome.results[case]
    return ({rank: result.output["shard_numel"] for rank, result in by_rank.items()},
            sum(result.output["padding"] for result in by_rank.values()))


def _shard_hint(got: list[int], numels: list[int], n: int, which: int) -> str:
    total = sum(numels)
    if got == [total // n, 0]:
        return (f": that is floor division ({total} // {n}); FSDP1 pads the FlatParameter to a multiple of the "
                f"world size, so each shard holds ceil({total} / {n}) elements")
    per_param = sum(-(-k // n) for k in numels)
    if got[0] == per_param and per_param != flat_shard(numels, n)[0]:
        return (": that pads each parameter to a multiple of the world size; FSDP1 flattens the unit's "
                "parameters into one FlatParameter first and pads that once, at its end")
    if which == 1 and total % n == 0 and got[1] == n:
        return f": {total} divides evenly by {n}, so there is no padding (ceil(total / n) * n - total)"
    return ""


def _shard_judge(which: int):
    """A judge of element `which` of the answer: 0, the shard's numel (every rank's); 1, the padding."""

    def judge(outcome: RunOutcome) -> list[str]:
        for case, by_rank in enumerate(outcome.results):
            numels = _numels(outcome, case)
            shards, padding = _real(outcome, case)
            for rank, result in sorted(by_rank.items()):
                got = result.output["answer"]
                where = f"rank {rank}, {_shard_label(outcome, case)}"
                if not isinstance(got, list):
                    return [f"{where}: shard_numel returned a {got}, expected a tuple of two ints (shard, padding)"]
                expected = shards[rank] if which == 0 else padding
                if got[which] == expected:
                    continue
                what = (f"shard numel is {got[0]}, FSDP's shard on rank {rank} holds {expected} elements" if which == 0
                        else f"padding is {got[1]}, FSDP padded the FlatParameter with {expected}")
                return [f"{where}: {what}{_shard_hint(got, numels, outcome.nproc, which)}"]
        return []

    judge.__doc__ = ("shard_numel's first value equals the numel of the FlatParameter's shard FSDP built on this rank"
                     if which == 0 else "shard_numel's second value equals the padding FSDP appended to it")
    return judge


SHAPES_2 = [[(6, 4), (6,), (2, 6), (2,)], [(13, 8), (13,), (5, 13), (5,)]]  # 44 elements (even), 187 (odd)
SHAPES_3 = [[(6, 4), (6,), (2, 6), (2,)], [(9,), (4, 4), (5,)], [(7, 6), (1,)]]  # 44, 30 (divides), 43

FLAT_SHARD = Exercise(
    id="04.flat_shard_numel",
    function="shard_numel",
    signature="shard_numel(param_numels: list[int], world_size: int) -> tuple[int, int]",
    driver="fsdp_flat_shard",
    allowed_ops=frozenset(),
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _shape_cases(n, SHAPES_2),
                (Item("the shard's numel equals FSDP's on every rank (2 ranks: 44 and 187 elements)", 1,
                      _shard_judge(0)),
                 Item("the padding equals FSDP's (2 ranks: 44 and 187 elements)", 1, _shard_judge(1))),
                timeout_s=10),
        RunSpec(3, lambda n: _shape_cases(n, SHAPES_3),
                (Item("the shard's numel equals FSDP's on every rank (3 ranks: 44, 30 and 43 elements)", 1,
                      _shard_judge(0)),
                 Item("the padding equals FSDP's (3 ranks: 44, 30 and 43 elements)", 1, _shard_judge(1))),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 4 'The FlatParameter: flattened, padded, split' (the pad column of the "
        "table).",
        "No torch call is needed, only integer arithmetic; FSDP1 does it in FlatParamHandle._get_shard "
        "(torch/distributed/fsdp/_flat_param.py).",
        "Put the unit's parameters end to end, grow the total to the next multiple of the world size, split "
        "that evenly; the padding is what the growing added.",
    ),
)

