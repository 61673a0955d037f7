"""Lesson 05's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/05_fsdp2.ipynb published (`cl.results`) and from its
ledger (`cl.ledgers`, the last `%%torchrun` cell's), and checks it against cl.theory's FSDP2 layout and
step: the padded shards (`fsdp2_padded_shard_numel`) and the collectives of one step
(`fsdp2_step_collectives`).
"""

from __future__ import annotations

from ..theory import fsdp2_padded_shard_numel, fsdp2_step_collectives
from ..vocabulary import data_flow
from .spec import Prediction, Tolerance

__all__ = ["PREDICTIONS"]

SETTINGS = ("True", "False", "2")  # the reshard_after_forward values asked about, in the question's order


def _calls(ledger: list[dict], span: list[float], flow: str) -> int:
    """How many of a rank's calls of one data flow (all_gather, reduce_scatter, ...) started within `span`."""
    return sum(1 for e in ledger if span[0] <= e["start"] <= span[1] and data_flow(e["op"]) == flow)


def _padded_formula(results) -> int:
    published = results["padded"][2]
    return 4 * sum(fsdp2_padded_shard_numel(tuple(shape), published["world"]) for shape in published["shapes"])


def _after_forward_formula(results) -> tuple:
    shapes = [tuple(shape) for unit in results["memory"][0]["units"] for shape in unit]
    whole = 4 * sum(fsdp2_padded_shard_numel(shape, 1) for shape in shapes)
    pairs = 4 * sum(fsdp2_padded_shard_numel(shape, 2) for shape in shapes)
    return 0, whole, pairs  # True frees all, False keeps all, 2 keeps each parameter sharded over 2 ranks


def _gathers_formula(results) -> tuple:
    published = results["memory"][0]
    units, world = [[tuple(s) for s in unit] for unit in published["units"]], published["world"]

    def gathers(**reshard) -> int:
        return sum(1 for op, _ in fsdp2_step_collectives(units, world, **reshard) if data_flow(op) == "all_gather")

    every_unit = gathers(root_reshard_after_forward=True)  # True, the root included
    # 2 regathers the same units in backward as True, over pairs of ranks instead of all of them.
    return every_unit, gathers(reshard_after_forward=False), every_unit


def _scatters_formula(results) -> tuple:
    units = results["accumulated"][0]["units"]
    return units - 1, units  # the Blocks every micro-batch; the root only once sync is back on


PREDICTIONS: dict[str, Prediction] = {
    "05.padded_bytes": Prediction(
        id="05.padded_bytes",
        question="bytes of parameter shards rank 2 of 3 holds, padding included",
        needs="padded",
        measure=lambda results, ledgers: results["padded"][2]["bytes"],
        formula=_padded_formula,
        explanation=("every rank's buffer holds ceil(rows / 3) rows of each parameter, whatever it owns: 6 of 0's 16 "
                     "rows, 11 of each up's 32, 6 of each down's 16, 2 of the head's 4, times the columns, times 4 "
                     "bytes. Rank 2 owns fewer rows (4, 10, 4 and none of the head) and the rest is padding, which "
                     "it stores and sends in every all-gather."),
        unit="B",
    ),
    "05.after_forward": Prediction(
        id="05.after_forward",
        question=("bytes rank 0 holds after forward in FSDP's extra parameter buffers (not its 4-way shards), "
                  "reshard_after_forward True, False, 2"),
        needs="memory",
        measure=lambda results, ledgers: tuple(results["memory"][0]["settings"][s]["after forward"]
                                               for s in SETTINGS),
        formula=_after_forward_formula,
        explanation=("True frees every unit's gathered parameters after its forward, the root's too (0); False keeps "
                     "every unit gathered until backward, the whole model (4 bytes x 2,356 parameters); 2 reshards "
                     "each parameter over pairs of ranks instead of all 4, so each rank keeps half of the model."),
        unit="B",
    ),
    "05.all_gathers": Prediction(
        id="05.all_gathers",
        question="all-gathers rank 0 issues in one training step, reshard_after_forward True, False, 2",
        needs="memory",
        measure=lambda results, ledgers: tuple(_calls(ledgers[0], results["memory"][0]["settings"][s]["step"],
                                                      "all_gather") for s in SETTINGS),
        formula=_gathers_formula,
        explanation=("forward gathers each of the 3 units once. True freed them all, so backward gathers all 3 "
                     "again (6); False kept them, so backward gathers none (3); 2 kept a half of each, so backward "
                     "gathers all 3 again, within pairs of ranks (6, each call with twice the bytes)."),
        unit="all-gathers",
    ),
    "05.accumulation_scatters": Prediction(
        id="05.accumulation_scatters",
        question="reduce-scatters in micro-batch 1 and 2 with set_requires_gradient_sync(..., recurse=False)",
        needs="accumulated",
        measure=lambda results, ledgers: tuple(_calls(ledgers[0], span, "reduce_scatter")
                                               for span in results["accumulated"][0]["wrong module"]["spans"]),
        formula=_scatters_formula,
        explanation=("recurse=False sets only the root's own group: the 2 Blocks keep sync on and reduce-scatter "
                     "in every backward, the root skips micro-batch 1 and reduce-scatters its sum in micro-batch 2 "
                     "(3 with the Blocks'). The result is right; the traffic you meant to save is not saved."),
        unit="reduce-scatters",
    ),
}
