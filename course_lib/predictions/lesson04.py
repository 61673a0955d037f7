"""Lesson 04's predictions (see course_lib/predictions/__init__.py).

The run cells publish what the formulas need: `flat` (`cl.sharding_of` on 3 ranks: each FlatParameter's
unsharded size, padding per rank), `strategies` (per sharding strategy, in the cell's order: the bytes
`cl.measure_step` found per phase, and `step_2`, step 2's [start, stop]), `flat_step` (the 3-rank forward and
backward's [start, stop]) and `unit_numels` (the elements of the root unit and of each Block). The ledgers are
the run cell's; a step's calls are those that started within its span (time.monotonic(), the ledger's clock).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Mapping

from .. import theory
from .spec import Prediction, Tolerance

__all__ = ["PREDICTIONS"]

FLOAT32 = 4


def _calls_in(ledger: list, span: list[float]) -> list:
    """A rank's ledger entries that started within `span`, a [start, stop] on the ledger's clock."""
    return [e for e in ledger if span[0] <= e["start"] <= span[1]]


def _shards(numels: list[int], world_size: int) -> list:
    """Rank by rank, the FlatShard of each unit (one FlatParameter of `numel` elements each)."""
    return [theory.fsdp1_flat_shards([("unit", n)], world_size) for n in numels]


# ---------------------------------------------------------------- 04.gather_bytes (3 ranks, section 4's cell)

def _flats(results: Mapping) -> tuple[list[int], int]:
    """(unsharded elements of each FlatParameter, root first; world size) of the 3-rank run."""
    first = results["flat"][0]
    return [f["unsharded_numel"] for f in first["flat"]], first["world_size"]


def _gather_measured(results: Mapping, ledgers: Mapping) -> int:
    return sum(e["bytes"] for e in _calls_in(ledgers[0], results["flat_step"][0]) if e["op"].startswith("all_gather"))


def _gather_formula(results: Mapping) -> int:
    numels, world = _flats(results)
    root, *blocks = [unit[0].shard_numel for unit in _shards(numels, world)]
    return FLOAT32 * (root + 2 * sum(blocks))  # the root once (kept to backward), each Block twice


def _padding_measured(results: Mapping, ledgers: Mapping) -> tuple:
    return tuple(sum(f["padding"] for f in data["flat"]) for _, data in sorted(results["flat"].items()))


def _padding_formula(results: Mapping) -> tuple:
    numels, world = _flats(results)
    units = _shards(numels, world)
    return tuple(sum(unit[rank].padding for unit in units) for rank in range(world))


# ---------------------------------------------------------------- 04.after_forward, 04.traffic (4 ranks, section 5)

def _strategy_numbers(results: Mapping) -> tuple[list[str], list[int], int]:
    """(the strategies in the cell's order, unit elements (root, Blocks), world size) of the 4-rank run."""
    return list(results["strategies"][0]), results["unit_numels"][0], len(results["strategies"])


def _after_forward_measured(results: Mapping, ledgers: Mapping) -> tuple:
    phases = {label: held["memory"]["forward"] for label, held in results["strategies"][0].items()}
    return phases["FULL_SHARD"]["buffers"], phases["SHARD_GRAD_OP"]["buffers"]


def _after_forward_formula(results: Mapping) -> tuple:
    _, numels, world = _strategy_numbers(results)
    gathered = [FLOAT32 * unit[0].shard_numel * world for unit in _shards(numels, world)]  # padding included
    return gathered[0], sum(gathered)  # FULL_SHARD: the root only; SHARD_GRAD_OP: every unit


def _sent(entry: dict, world: int) -> Fraction:
    """Bytes a rank sends in a ring for one ledger entry ("bytes" is what it put in)."""
    if entry["op"].startswith("all_gather"):
        return Fraction(entry["bytes"] * (world - 1))  # its shard, to each of the others
    if entry["op"].startswith("reduce_scatter"):
        return Fraction(entry["bytes"] * (world - 1), world)
    if entry["op"] == "all_reduce":
        return Fraction(2 * entry["bytes"] * (world - 1), world)
    return Fraction(0)


def _traffic_measured(results: Mapping, ledgers: Mapping) -> tuple:
    labels, _, world = _strategy_numbers(results)
    step_2 = {label: _calls_in(ledgers[0], results["strategies"][0][label]["step_2"]) for label in labels}
    return tuple(round(sum(_sent(e, world) for e in step_2[label])) for label in ("FULL_SHARD", "NO_SHARD"))


def _traffic_formula(results: Mapping) -> tuple:
    _, numels, world = _strategy_numbers(results)
    padded = [FLOAT32 * unit[0].shard_numel * world for unit in _shards(numels, world)]
    root, *blocks = padded
    gathers = theory.ring_all_gather_bytes(root + 2 * sum(blocks), world)  # the root once, each Block twice
    reduce_scatters = theory.ring_reduce_scatter_bytes(sum(padded), world)
    all_reduce = theory.ring_all_reduce_bytes(FLOAT32 * sum(numels), world)
    return round(gathers + reduce_scatters), round(all_reduce)


PREDICTIONS: dict[str, Prediction] = {
    "04.gather_bytes": Prediction(
        id="04.gather_bytes",
        question="bytes rank 0 puts into all-gathers in one step on 3 ranks",
        needs="flat",
        measure=_gather_measured,
        formula=_gather_formula,
        explanation=(
            "on 3 ranks each FlatParameter is padded to a multiple of 3 and split: the root's 212 elements to "
            "213 (71 a rank), a Block's 1,072 to 1,074 (358 a rank). An all-gather's input is the rank's own "
            "shard. In one step rank 0 puts in its root shard once (FSDP1 keeps the root unit gathered from "
            "forward to backward) and each Block's shard twice (forward, and again in backward, since "
            "FULL_SHARD freed it after forward): 4 B x (71 + 2 x 2 x 358) = 6,012 B."),
        unit="B",
        tolerance=Tolerance(),
    ),
    "04.flat_padding": Prediction(
        id="04.flat_padding",
        question="padding elements each rank holds over the three FlatParameters (rank 0, 1, 2)",
        needs="flat",
        measure=_padding_measured,
        formula=_padding_formula,
        explanation=(
            "the zeros are appended at the end of each FlatParameter, so they land in the last rank's piece: "
            "1 for the root (213 - 212) and 2 for each Block (1,074 - 1,072), all on rank 2. Only when the "
            "padding is longer than a piece does it spill onto the rank before (5 elements on 4 ranks: pieces "
            "of 2, 2, 1 and 0 real elements)."),
        tolerance=Tolerance(),
    ),
    "04.after_forward": Prediction(
        id="04.after_forward",
        question="bytes of gathered parameters rank 0 holds after forward on 4 ranks (FULL_SHARD, SHARD_GRAD_OP)",
        needs="strategies",
        measure=_after_forward_measured,
        formula=_after_forward_formula,
        explanation=(
            "FULL_SHARD frees each Block right after its forward but keeps the root unit gathered until its "
            "backward: 212 elements, 848 B (212 divides by 4, no padding). SHARD_GRAD_OP keeps every unit "
            "gathered from its forward to the end of backward: all 2,356 elements, 9,424 B, the whole model on "
            "every rank while the step runs (between steps it holds only its shard, as FULL_SHARD does)."),
        unit="B",
        tolerance=Tolerance(),
    ),
    "04.traffic": Prediction(
        id="04.traffic",
        question="bytes rank 0 sends in step 2 on 4 ranks, ring collectives (FULL_SHARD, NO_SHARD)",
        needs="strategies",
        measure=_traffic_measured,
        formula=_traffic_formula,
        explanation=(
            "FULL_SHARD all-gathers the root once and each Block twice: 4,500 B put in, each rank sends its "
            "shard to the 3 others, 13,500 B; then it reduce-scatters every gradient, 3/4 x 9,424 = 7,068 B: "
            "20,568 B in all. NO_SHARD all-reduces the same 9,424 B of gradients: 2 x 3/4 x 9,424 = 14,136 B. "
            "FULL_SHARD sends 1.46 times what DDP sends: per Block one all-gather more than the two halves of "
            "an all-reduce (the textbook 1.5 times), a little less here because the root is gathered once."),
        unit="B",
        tolerance=Tolerance(relative=0.01),
    ),
}
