"""07.reshard_load: a checkpoint saved by FSDP2 on N ranks loaded into another layout, in place.

Judged: the parameters, Adam's moments and step counts, and Adam's lr (the target starts at another one)
against one process after 2 steps.
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import DCP_PRELOAD, one_process, state_wrong
from .drivers import DECAY, DECAY_EVERY, LR

__all__ = ["RESHARD_LOAD"]

RESHARD_HINTS = (
    "Reread lesson 07, section 4 'Resharding on load' and section 7 '4 -> 2'.",
    "get_state_dict and set_state_dict from torch.distributed.checkpoint.state_dict; "
    "torch.distributed.checkpoint.load with checkpoint_id.",
    "Ask the model and the optimizer for state dicts in their own layout (the keys and this rank's pieces), "
    "let DCP fill them in place from the folder under the same keys the save used, then hand them back to "
    "the model and the optimizer (the tensors may be filled in place, Adam's lr is not).",
)

STEPS = 2


def _reshard_label(outcome: RunOutcome, case: int) -> str:
    layout = outcome.inputs[case][0][1]
    saved = f"saved by {outcome.nproc} ranks, FSDP2"
    return (f"{saved}, loaded with each rank holding half of the rows ({outcome.nproc} ranks, a (2, "
            f"{outcome.nproc // 2}) mesh)" if layout == "halves" else f"{saved}, loaded into an unsharded model on every rank")


def _loaded(parts):
    def judge(outcome: RunOutcome) -> list[str]:
        _, want = one_process(STEPS)
        for case, rank, result in each_result(outcome):
            out = result.output
            where = f"rank {rank}, {_reshard_label(outcome, case)}"
            if out["returned"] is not None:
                return [f"{where}: the function returned a {out['returned']}; it loads in place and returns None"]
            wrong = state_wrong(out["loaded"], want, parts)
            if wrong:
                if parts[0] != "model" and not out["loaded"]["exp_avg"]:
                    wrong += ": the optimizer's state was not loaded"
                return [f"{where}: after the load, {wrong} (one process after {STEPS} Adam steps)"]
            if parts[0] != "model" and out["loaded"]["lr"] != LR * DECAY ** (STEPS // DECAY_EVERY):
                return [f"{where}: after the load, Adam's lr is {out['loaded']['lr']:g}, the checkpoint's "
                        f"{LR * DECAY ** (STEPS // DECAY_EVERY):g} (its param_groups): dcp.load filled the "
                        "tensors in place but only set_state_dict hands param_groups back to the optimizer"]
        return []
    return judge


RESHARD_LOAD = Exercise(
    id="07.reshard_load",
    hints=RESHARD_HINTS,
    function="load_resharded",
    signature="load_resharded(model, optimizer, folder: str) -> None",
    driver="dcp_reshard_load",
    preload=DCP_PRELOAD,
    runs=(
        RunSpec(4, lambda n: [{r: (STEPS, "halves", "reshard_halves") for r in range(n)}],
                (Item("4 -> 2: the parameters equal one process after 2 steps (4 ranks)", 1, _loaded(("model",))),
                 Item("4 -> 2: Adam's moments, step counts and lr equal one process's (4 ranks)", 1,
                      _loaded(("exp_avg", "exp_avg_sq", "steps")))),
                timeout_s=40),
        RunSpec(2, lambda n: [{r: (STEPS, "whole", "reshard_whole") for r in range(n)}],
                (Item("2 -> unsharded: the parameters equal one process after 2 steps (2 ranks)", 1,
                      _loaded(("model",))),
                 Item("2 -> unsharded: Adam's moments, step counts and lr equal one process's (2 ranks)", 1,
                      _loaded(("exp_avg", "exp_avg_sq", "steps")))),
                timeout_s=30),
    ),
)
