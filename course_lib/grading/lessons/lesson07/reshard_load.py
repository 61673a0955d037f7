"""07.reshard_load: one process's torch.save checkpoint (model and Adam, whole tensors) resumed on N ranks in an
FSDP2 layout, the file read by rank 0 only.

Judged: the parameters, Adam's moments, step counts and lr (the target starts at another one) on every rank
against one process after 2 steps, and that no rank but 0 reads anything on rank 0's disk (each rank works in
a folder of its own; the driver records the other ranks' reads there) or receives half the checkpoint or more in
one object (measured in the driver: the ledger does not size object collectives) or one tensor (the ledger).
"""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import DCP_PRELOAD, one_process, state_wrong
from .drivers import DECAY, DECAY_EVERY, LR

__all__ = ["RESHARD_LOAD"]

RESHARD_HINTS = (
    "Reread lesson 07, section 4 'Resharding on load' (its note on whole tensors) and lesson 05's load of whole "
    "tensors into a sharded model; the file holds get_state_dict's two dicts, as section 9's export does.",
    "torch.load(..., weights_only=True); set_model_state_dict and set_optimizer_state_dict (or set_state_dict, "
    "which takes an empty model dict for 'the optimizer only'), with StateDictOptions, all from "
    "torch.distributed.checkpoint.state_dict.",
    "Every rank takes part in the load, telling it that the dicts hold whole tensors and that only rank 0 has "
    "them: it then broadcasts them one tensor at a time and each rank keeps its own pieces. set_state_dict reads "
    "an empty model dict as 'the optimizer only' and then skips the model's broadcasts that rank 0 makes.",
)

STEPS = 2
SAVED_LR = LR * DECAY ** (STEPS // DECAY_EVERY)  # the checkpoint's lr: the schedule decayed it


def _label(outcome: RunOutcome, case: int) -> str:
    layout = outcome.inputs[case][0][1]
    if layout == "halves":
        return (f"loaded on {outcome.nproc} ranks over a (2, {outcome.nproc // 2}) mesh (HSDP, each rank holding "
                "half of the rows)")
    return f"loaded on {outcome.nproc} ranks over a mesh of {outcome.nproc} (FSDP2)"


def _loaded(parts):
    def judge(outcome: RunOutcome) -> list[str]:
        _, want = one_process(STEPS)
        for case, rank, result in each_result(outcome):
            out = result.output
            where = f"rank {rank}, {_label(outcome, case)}"
            if out["returned"] is not None:
                return [f"{where}: the function returned a {out['returned']}; it loads in place and returns None"]
            wrong = state_wrong(out["loaded"], want, parts)
            if wrong:
                if parts[0] != "model" and not out["loaded"]["exp_avg"]:
                    wrong += ": the optimizer's state was not loaded"
                elif rank:
                    wrong += (": rank 0's load did not reach this rank (only rank 0 has the file; the others "
                              "must receive their pieces from it)")
                return [f"{where}: after the load, {wrong} (one process after {STEPS} Adam steps)"]
            if parts[0] != "model" and out["loaded"]["lr"] != SAVED_LR:
                return [f"{where}: after the load, Adam's lr is {out['loaded']['lr']:g}, the checkpoint's "
                        f"{SAVED_LR:g} (its param_groups): the optimizer's state dict was not handed back to it"]
        return []
    return judge


def _received_in_pieces(outcome: RunOutcome) -> list[str]:
    """No rank but 0 reads a file of rank 0's disk (the checkpoint, or a copy rank 0 wrote) or receives half the
    checkpoint or more in one object or one tensor: rank 0 alone holds it all."""
    _, want = one_process(STEPS)
    whole = sum(t.numel() * t.element_size() for part in ("model", "exp_avg", "exp_avg_sq") for t in want[part].values())
    for case, rank, result in each_result(outcome):
        if rank == 0:
            continue
        read = result.output["read"]
        where = f"rank {rank}, {_label(outcome, case)}"
        checkpoint = outcome.inputs[case][rank][2]
        if checkpoint in read:
            return [f"{where}: it opened {checkpoint!r}, the checkpoint file, which lies on rank 0's disk only (the "
                    "other ranks cannot read it, and no rank but 0 may hold it all): only rank 0 reads it; the "
                    "others receive their pieces from rank 0 through the load"]
        if read:
            return [f"{where}: it read {read[:3]}, which rank 0 wrote on its own disk: no other rank sees what rank "
                    "0 writes (each works on a disk of its own), so a copy rank 0 makes of the file (a DCP folder "
                    "from torch_save_to_dcp, for one) cannot reach them; let the load send each rank its pieces "
                    "from rank 0"]
        objects = result.output["objects"]
        tensors = [entry["bytes"] for entry in result.ledger if entry.get("op") and entry.get("bytes")]
        largest = max(objects + tensors, default=0)
        if largest >= whole / 2:
            how = "one object from an object collective" if largest in objects else "one tensor"
            return [f"{where}: it received {largest:,} bytes in {how}, at least half "
                    f"of the checkpoint's {whole:,} bytes of tensors: it held the whole state at once, which "
                    "sharding keeps off every rank but 0; let the load send it one tensor at a time"]
    return []


RESHARD_LOAD = Exercise(
    id="07.reshard_load",
    hints=RESHARD_HINTS,
    function="load_resharded",
    signature="load_resharded(model, optimizer, path: str | None) -> None",
    driver="dcp_reshard_load",
    preload=DCP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [{r: (STEPS, "shards", "one_process.pt") for r in range(n)}],
                (Item("one process -> FSDP2: the parameters equal one process after 2 steps (2 ranks)", 1,
                      _loaded(("model",))),
                 Item("one process -> FSDP2: Adam's moments, step counts and lr equal one process's (2 ranks)", 1,
                      _loaded(("exp_avg", "exp_avg_sq", "steps"))),
                 Item("one process -> FSDP2: rank 1 reads nothing on rank 0's disk and never receives half the "
                      "checkpoint or more at once (2 ranks)", 1, _received_in_pieces)),
                timeout_s=30),
        RunSpec(4, lambda n: [{r: (STEPS, "halves", "one_process.pt") for r in range(n)}],
                (Item("one process -> HSDP (2, 2): the parameters equal one process after 2 steps (4 ranks)", 1,
                      _loaded(("model",))),
                 Item("one process -> HSDP (2, 2): Adam's moments, step counts and lr equal one process's (4 ranks)",
                      1, _loaded(("exp_avg", "exp_avg_sq", "steps")))),
                timeout_s=40),
    ),
)
