"""04.flat_shard_numel: each rank's piece of a FlatParameter with use_orig_params=True (each parameter aligned
to 16 bytes) and all its padding, against what FSDP1 built."""

from __future__ import annotations

import math

from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import FSDP_PRELOAD

__all__ = ["FLAT_SHARD", "flat_shard"]

FLOAT32 = 4  # bytes; FSDP1 aligns each parameter's start to 16 bytes (torch: _flat_param._get_aligned_numel)


def flat_shard(param_numels: list[int], world_size: int, *, align: int = 16 // FLOAT32,
               align_end: bool = False) -> tuple[int, int]:
    """(elements in each rank's shard, padding) of one float32 FlatParameter of FULL_SHARD with
    use_orig_params=True: each parameter after the first starts at a multiple of `align` elements (zeros in
    between), then zeros at the end to a multiple of the world size. align=1 is use_orig_params=False's layout;
    align_end=True (a wrong answer) also aligns the end of the last parameter."""
    at = 0
    for numel in param_numels:
        at = -(-at // align) * align + numel
    if align_end:
        at = -(-at // align) * align
    shard = -(-at // world_size)
    return shard, shard * world_size - sum(param_numels)


def _shape_cases(n: int, specs: list[list[tuple]]) -> list[dict[int, tuple]]:
    return [{r: ([list(shape) for shape in shapes],) for r in range(n)} for shapes in specs]


def _numels(outcome: RunOutcome, case: int) -> list[int]:
    return [math.prod(shape) for shape in outcome.inputs[case][0][0]]


def _shard_label(outcome: RunOutcome, case: int) -> str:
    numels = _numels(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} (param_numels={numels}, {sum(numels)} elements, "
            f"world_size={outcome.nproc})")


def _real(outcome: RunOutcome, case: int) -> tuple[dict[int, int], int]:
    """({rank: elements its shard holds}, the FlatParameter's padding), as FSDP built them: the zeros inside the
    unsharded FlatParameter (alignment, and the world-size padding use_orig_params=True puts at its end) plus
    those appended to the shards."""
    by_rank = outcome.results[case]
    return ({rank: result.output["shard_numel"] for rank, result in by_rank.items()},
            by_rank[0].output["inside"] + sum(result.output["padding"] for result in by_rank.values()))


def _shard_hint(got: list[int], numels: list[int], n: int, which: int) -> str:
    right = flat_shard(numels, n)
    total = flat_shard(numels, 1)[0]  # where the last parameter ends, alignment included
    if got == list(flat_shard(numels, n, align=1)):
        return (": that is use_orig_params=False's layout, the parameters back to back; with use_orig_params=True "
                "each parameter starts on a 16-byte boundary, which may leave zeros between them")
    if got[0] == total // n and got[0] != right[0]:
        return (f": that is floor division ({total} // {n}); the FlatParameter is padded to a multiple of the "
                "world size, so no element is left out of a shard")
    if got == list(flat_shard(numels, n, align=16)) and got != list(right):
        return ": 16 bytes are not 16 elements: a float32 element is 4 bytes"
    if got == list(flat_shard(numels, n, align_end=True)) and got != list(right):
        return (": that aligns the end of the last parameter too; alignment is where a parameter starts, and "
                "only the world size pads the end")
    if which == 1 and total % n == 0 and got[1] == right[1] + n:
        return f": {total} elements divide evenly by {n}, so nothing is added at the end"
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
                        else f"padding is {got[1]}, the FlatParameter FSDP built holds {expected} elements of padding")
                return [f"{where}: {what}{_shard_hint(got, numels, outcome.nproc, which)}"]
        return []

    judge.__doc__ = ("shard_numel's first value equals the numel of the FlatParameter's shard FSDP built on this rank"
                     if which == 0 else "shard_numel's second value equals all the padding FSDP put in it")
    return judge


SHAPES_2 = [[(6, 4), (6,), (2, 6), (2,)], [(13, 8), (13,), (5, 13), (5,)]]  # 44 elements (46 aligned), 187 (193)
SHAPES_3 = [[(6, 4), (6,), (2, 6), (2,)], [(9,), (4, 4), (5,)], [(42,), (3,)]]  # 44 (46), 30 (33: divides), 45 (47)

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
                (Item("the shard's numel equals FSDP's on every rank (3 ranks: 44, 30 and 45 elements)", 1,
                      _shard_judge(0)),
                 Item("the padding equals FSDP's (3 ranks: 44, 30 and 45 elements)", 1, _shard_judge(1))),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 4 'The FlatParameter: flattened, padded, split': the pad column, and the "
        "paragraph on use_orig_params=True after the table (the options appendix, section 1, shows it).",
        "No torch call is needed, only integer arithmetic; FSDP1 builds the layout in "
        "FlatParamHandle._init_flat_param_and_metadata (torch/distributed/fsdp/_flat_param.py).",
        "Lay the parameters end to end in order, moving each one's start forward to the next 16-byte boundary "
        "(counted in float32 elements) when it is not on one; then grow the total to a multiple of the world "
        "size and split it evenly. Every element that is not a parameter's is padding.",
    ),
)
