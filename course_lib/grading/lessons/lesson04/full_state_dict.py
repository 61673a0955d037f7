"""04.full_state_dict: a FULL_STATE_DICT gathered and saved on rank 0, loaded by the plain model."""

from __future__ import annotations

import io

from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import (FSDP1_OPS, FSDP_PRELOAD, LR, TOY, compare_params, draw_batch, draw_weights, sgd_reference,
                     toy)

__all__ = ["FULL_STATE_DICT"]

def _save_case(n: int, weights_seed: int, steps: int, rows: int, batch_seed: int, index: int) -> dict[int, tuple]:
    from ....models import ToyModel

    weights = draw_weights(lambda: ToyModel(**TOY), weights_seed)
    inputs, targets = draw_batch(steps * n * rows, TOY["dim"], TOY["out"], batch_seed)
    case = {}
    for r in range(n):
        starts = [(k * n + r) * rows for k in range(steps)]
        case[r] = (TOY, weights, [(inputs[s:s + rows], targets[s:s + rows]) for s in starts], LR,
                   f"model_case{index}.pt")
    return case


def _save_label(outcome: RunOutcome, case: int) -> str:
    steps = outcome.inputs[case][0][2]
    return (f"case {case + 1} of {len(outcome.inputs)} ({len(steps)} SGD step{'s' * (len(steps) != 1)}, "
            f"{steps[0][0].shape[0]} rows per rank per step)")


def _loaded(outcome: RunOutcome, case: int):
    """(a plain ToyModel that loaded rank 0's file with strict=True, "") or (None, what went wrong)."""
    import torch

    from ....models import ToyModel

    where = f"rank 0, {_save_label(outcome, case)}"
    described = outcome.results[case][0].output["file"]
    if described is None:
        return None, (f"{where}: no file at the path given after save_full_state_dict returned; rank 0 must "
                      "torch.save(state, path)")
    try:
        state = torch.load(io.BytesIO(described["bytes"].numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - not a file torch.save wrote, or not plain tensors
        keys, types = described.get("keys", []), described.get("types", [])
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}" if str(exc) else type(exc).__name__
        if any(k.endswith("_flat_param") for k in keys):
            return None, (f"{where}: the file holds FSDP's flat parameters ({', '.join(keys)}: a LOCAL_STATE_DICT); "
                          "use StateDictType.FULL_STATE_DICT, whose keys and shapes are the plain model's")
        if types and "Tensor" not in types:
            return None, (f"{where}: the file holds {', '.join(types)} values, not plain tensors (a "
                          "SHARDED_STATE_DICT?); use StateDictType.FULL_STATE_DICT")
        return None, f"{where}: torch.load(weights_only=True) could not read the file ({why})"
    plain = ToyModel(**TOY)
    expected_keys = list(plain.state_dict())
    if not isinstance(state, dict):
        return None, f"{where}: the file holds a {type(state).__name__}, not a state dict"
    if not state:
        return None, (f"{where}: the file holds an empty dict; with rank0_only=True only rank 0's state_dict() "
                      "holds the parameters")
    if sorted(state) != sorted(expected_keys):
        return None, (f"{where}: the file's keys are {', '.join(sorted(map(str, state)))}, expected the plain "
                      f"model's {', '.join(expected_keys)}; use StateDictType.FULL_STATE_DICT")
    try:
        plain.load_state_dict(state, strict=True)
    except Exception as exc:  # noqa: BLE001 - shapes of another model (a shard)
        return None, (f"{where}: the plain model could not load it ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:200]}); the values must be whole (FULL_STATE_DICT)")
    return plain, ""


def _loads(outcome: RunOutcome) -> list[str]:
    """Rank 0's file loads into the plain (unwrapped) model with load_state_dict(strict=True)."""
    for case in range(len(outcome.results)):
        model, problem = _loaded(outcome, case)
        if model is None:
            return [problem]
    return []


def _saved_equal(outcome: RunOutcome) -> list[str]:
    """The loaded parameters equal one process's SGD on the whole batches."""
    import torch

    for case in range(len(outcome.results)):
        model, problem = _loaded(outcome, case)
        if model is None:
            return [problem]
        weights, steps, lr = outcome.inputs[case][0][1], len(outcome.inputs[case][0][2]), outcome.inputs[case][0][3]
        shards = [outcome.inputs[case][r][2] for r in range(outcome.nproc)]
        whole = [(torch.cat([s[k][0] for s in shards]), torch.cat([s[k][1] for s in shards])) for k in range(steps)]
        expected = sgd_reference(toy(weights), whole, lr)
        got = {name: p.detach() for name, p in model.named_parameters()}
        wrong = compare_params(got, expected, f"rank 0, {_save_label(outcome, case)}: the saved")
        if wrong:
            return [wrong]
    return []


def _rank_0_only(outcome: RunOutcome) -> list[str]:
    """No rank but 0 writes a file (each rank is given a path of its own, so any file shows)."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            described = result.output["file"]
            if rank == 0 or described is None:
                continue
            where = f"rank {rank}, {_save_label(outcome, case)}"
            if described.get("keys") == []:
                return [f"{where}: this rank saved a file holding an empty dict: with rank0_only=True only rank 0's "
                        "state_dict() holds the parameters, and on a shared path its empty file could be the last "
                        "written; save on rank 0 only"]
            return [f"{where}: this rank saved a file too (keys: {', '.join(described.get('keys', [])[:3]) or '?'}"
                    "...); save on rank 0 only: ranks writing one path overwrite "
                    "each other"]
    return []


def _rank_0_holds_it(outcome: RunOutcome) -> list[str]:
    """No rank but 0 holds the whole model's state dict: each full state_dict() elsewhere is empty."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            whole = [call for call in result.output["built"] if call["type"] == "FULL_STATE_DICT" and call["entries"]]
            if rank == 0 or not whole:
                continue
            return [f"rank {rank}, {_save_label(outcome, case)}: state_dict() gave this rank the whole model too "
                    f"({whole[0]['entries']} entries): FSDP1's default full state dict gathers every parameter on "
                    "every rank, a copy of the model per rank; only rank 0 must keep it"]
    return []


FULL_STATE_DICT = Exercise(
    id="04.full_state_dict",
    function="save_full_state_dict",
    signature="save_full_state_dict(model: FullyShardedDataParallel, path: str) -> None",
    driver="fsdp_save",
    # all_gather_object: FSDP's LOCAL and SHARDED state dicts build ShardedTensors, which check their metadata
    # with it. Allowed, so that an answer using them gets the judges' words on the file, not a refusal.
    allowed_ops=FSDP1_OPS | {"all_gather_object"},
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_save_case(n, 46, 2, 4, 146, 1)],
                (Item("rank 0's file loads into the plain model with strict=True (2 ranks)", 1, _loads),
                 Item("its parameters equal one process's after 2 SGD steps on the whole batch (2 ranks)", 1,
                      _saved_equal),
                 Item("no other rank writes a file (2 ranks)", 1, _rank_0_only),
                 Item("no other rank holds the whole model's state dict (2 ranks)", 1, _rank_0_holds_it)),
                timeout_s=10),
        RunSpec(3, lambda n: [_save_case(n, 47, 1, 2, 147, 1)],
                (Item("its parameters equal one process's after 1 SGD step on the whole batch (3 ranks)", 1,
                      _saved_equal),
                 Item("no other rank holds the whole model's state dict (3 ranks)", 1, _rank_0_holds_it)),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 9 'State dicts: the checkpoints you save' (the FULL kind, rank0_only, and who "
        "must call state_dict()).",
        "FullyShardedDataParallel.state_dict_type with StateDictType.FULL_STATE_DICT and FullStateDictConfig "
        "(rank0_only; offload_to_cpu only from a GPU); torch.save.",
        "Building the full state dict all-gathers every unit, so every rank builds it; only rank 0 then holds"
        " the tensors, and only rank 0 writes the file.",
    ),
)
