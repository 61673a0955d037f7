"""Lesson 04's exercises: FSDP1's auto-wrap policy, a FlatParameter's shard size, gradient clipping, a full checkpoint.

Every run wraps a small model in `FullyShardedDataParallel` (FULL_SHARD,
use_orig_params=False, gloo, `device_id=torch.device("cpu")`) on real ranks.
The models: `drivers.wrap_model` (a stem of two Linears, Blocks, a head) for
the policy, `course_lib.models.ToyModel` (two Blocks and a head) for clipping
and saving, weights drawn here, in the checker's process, from a fixed seed.
The references are one process, computed here without torch.distributed: the
units the policy's rule names, SGD on the whole batch, `clip_grad_norm_` on
the whole batch's gradients; the shard size is what FSDP itself built on each
rank. Judges name the rank, the case and the first wrong value, and recognise
the usual mistakes (no `recurse` branch, every Linear wrapped, `>` for "at
least", floor division, padding per parameter, the norm of this rank's shard
only, a state dict of another type, empty files from the other ranks).
"""

from __future__ import annotations

import io
import math

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["ATOL", "EXERCISES", "FSDP1_OPS", "LR", "MIN_NUMEL", "RTOL", "expected_units", "flat_shard",
           "sgd_reference"]

RTOL, ATOL = 1e-5, 1e-6  # float32 results that differ from one process only by the order of additions
LR = 0.1  # SGD's learning rate
MIN_NUMEL = 1000  # 04.wrap_policy: a Linear outside a Block with at least this many parameters is a unit
# FSDP1's collectives: on CPU (torch 2.13, 2.15) it all-gathers with the list form and reduce-scatters
# with reduce_scatter_single; on a GPU and older torch, the flat forms' other spellings.
FSDP1_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                       "reduce_scatter_single"})
FSDP_PRELOAD = ("torch.distributed.fsdp",)  # about 0.8 s a process, 130 modules
TOY = {"dim": 8, "hidden": 13, "layers": 2, "out": 5}  # course_lib.models.ToyModel's defaults: 503 parameters


def _batch(size: int, features: int, out: int, seed: int) -> tuple:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, features, generator=generator), torch.randn(size, out, generator=generator)


def _weights(build, seed: int) -> dict:
    """A state dict drawn as torch draws the model's parameters, from `seed`."""
    import torch

    torch.manual_seed(seed)
    return {name: value.detach().clone() for name, value in build().state_dict().items()}


def sgd_reference(model, steps: list, lr: float) -> dict:
    """{name: parameter} after one SGD(lr) step on mse_loss per (inputs, targets) of `steps`: one process."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for inputs, targets in steps:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _compare_params(got: dict, expected: dict, where: str) -> str:
    """The first parameter of `got` that differs from `expected` (or is missing), in words ("" if none)."""
    for name, want in expected.items():
        if name not in got:
            return f"{where}: no parameter {name} (got {', '.join(sorted(got)) or 'none'})"
        wrong = first_difference(got[name], want, rtol=RTOL, atol=ATOL)
        if wrong:
            return f"{where}: {name} {wrong}"
    return ""


# ---------------------------------------------------------------- 04.wrap_policy


def _policy_case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    from .drivers import wrap_model

    weights = _weights(lambda: wrap_model(sizes), weights_seed)
    inputs, targets = _batch(n * rows, sizes["features"], sizes["out"], batch_seed)
    return {r: (sizes, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR)
            for r in range(n)}


def _linears(sizes: dict) -> dict[str, tuple[int, bool]]:
    """{name: (parameters, inside a Block)} of every Linear of wrap_model(sizes)."""
    import torch

    from ....models import Block
    from .drivers import wrap_model

    model = wrap_model(sizes)
    inside = {f"{name}.{child}" for name, m in model.named_modules() if isinstance(m, Block)
              for child, _ in m.named_modules() if child}
    return {name: (sum(p.numel() for p in m.parameters()), name in inside)
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def expected_units(sizes: dict, min_numel: int = MIN_NUMEL, strictly_more: bool = False) -> list[str]:
    """The FSDP units of wrap_model(sizes) under the policy's rule: the root (""), every Block, every Linear
    outside a Block with at least `min_numel` parameters (more than, with `strictly_more`), in module order."""
    from ....models import Block
    from .drivers import wrap_model

    linears = _linears(sizes)
    units = []
    for name, module in wrap_model(sizes).named_modules():
        numel, inside = linears.get(name, (0, True))
        big = numel > min_numel if strictly_more else numel >= min_numel
        if name == "" or isinstance(module, Block) or (name in linears and not inside and big):
            units.append(name)
    return units


def _policy_label(outcome: RunOutcome, case: int) -> str:
    sizes = outcome.inputs[case][0][0]
    return (f"case {case + 1} of {len(outcome.inputs)} ({sizes['layers']} Blocks, "
            f"stem.0 Linear({sizes['features']}, {sizes['width']}), head Linear({sizes['dim']}, {sizes['out']}))")


def _units_hint(got: list[str], sizes: dict) -> str:
    linears = _linears(sizes)
    expected = expected_units(sizes)
    missing = [name for name in expected if name not in got]
    extra = [name for name in got if name not in expected]
    if got == [""]:
        return ("only the root is a unit: FSDP first asks the policy with recurse=True whether to look inside a "
                "module (nonwrapped_numel is then everything below it); return True there, and decide with "
                "recurse=False")
    if got == expected_units(sizes, strictly_more=True):
        exact = [name for name in missing if linears.get(name, (0,))[0] == MIN_NUMEL]
        return (f"{exact[0]} has exactly {MIN_NUMEL} parameters: 'at least' is nonwrapped_numel >= MIN_NUMEL, "
                "not >")
    inside = [name for name in extra if linears.get(name, (0, False))[1]]
    small = [name for name in extra if name in linears and not linears[name][1]]
    if inside:
        return (f"{inside[0]} is a Linear inside a Block ({linears[inside[0]][0]} parameters): its Block's unit "
                f"holds it; wrap a Linear only with at least {MIN_NUMEL} parameters, and Blocks whatever their size")
    if small:
        return (f"{small[0]} has {linears[small[0]][0]} parameters, fewer than {MIN_NUMEL}: leave it to its parent's "
                "unit")
    blocks = [name for name in missing if name.startswith("blocks.")]
    if blocks:
        return f"{blocks[0]} is a Block: every Block must be a unit of its own (isinstance(module, Block))"
    return f"missing {', '.join(missing) or 'none'}; not expected {', '.join(extra) or 'none'}"


def _units(outcome: RunOutcome) -> list[str]:
    """The modules that became FSDP units (FSDP.fsdp_modules, named as in the plain model) are the expected ones."""
    for case, by_rank in enumerate(outcome.results):
        sizes = outcome.inputs[case][0][0]
        expected = expected_units(sizes)
        for rank, result in sorted(by_rank.items()):
            got = result.output["units"]
            if got == expected:
                continue
            shown = lambda names: "[" + ", ".join(repr(n) for n in names) + "]"  # noqa: E731
            return [f"rank {rank}, {_policy_label(outcome, case)}: the FSDP units are {shown(got)}, expected "
                    f"{shown(expected)}: {_units_hint(got, sizes)}"]
    return []


def _policy_trained(outcome: RunOutcome) -> list[str]:
    """After one SGD step every rank's whole parameters equal one process's step on the whole batch."""
    import torch

    from .drivers import wrap_model

    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, _, lr = outcome.inputs[case][0]
        inputs = torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)])
        targets = torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)])
        model = wrap_model(sizes)
        model.load_state_dict(weights)
        expected = sgd_reference(model, [(inputs, targets)], lr)
        for rank, result in sorted(by_rank.items()):
            wrong = _compare_params(result.output["params"], expected, f"rank {rank}, {_policy_label(outcome, case)}")
            if wrong:
                return [wrong]
    return []


WRAP_A = {"features": 9, "width": 100, "dim": 8, "hidden": 13, "layers": 2, "out": 5}  # stem.0: exactly 1000
WRAP_B = {"features": 26, "width": 37, "dim": 8, "hidden": 13, "layers": 3, "out": 120}  # stem.0: 999, head: 1080

WRAP_POLICY = Exercise(
    id="04.wrap_policy",
    function="policy",
    signature="policy(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool",
    driver="fsdp_wrap_policy",
    allowed_ops=FSDP1_OPS,
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_policy_case(n, WRAP_A, 41, 2, 141)],
                (Item("the FSDP units: the root, each Block, stem.0 with exactly 1000 parameters (2 ranks)", 1,
                      _units),
                 Item("one SGD step equals one process on the whole batch (2 ranks)", 1, _policy_trained)),
                timeout_s=10),
        RunSpec(3, lambda n: [_policy_case(n, WRAP_B, 42, 2, 142)],
                (Item("the FSDP units: the root, each Block, the head with 1080 parameters (3 ranks)", 1, _units),
                 Item("one SGD step equals one process on the whole batch (3 ranks)", 1, _policy_trained)),
                timeout_s=10),
    ),
)


# ---------------------------------------------------------------- 04.flat_shard_numel


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
)


# ---------------------------------------------------------------- 04.clip_grad_norm


def _toy(weights: dict):
    from .drivers import toy_from_weights

    return toy_from_weights(TOY, weights)


def _toy_case(n: int, weights_seed: int, rows: int, batch_seed: int, extra) -> dict[int, tuple]:
    from ....models import ToyModel

    weights = _weights(lambda: ToyModel(**TOY), weights_seed)
    inputs, targets = _batch(n * rows, TOY["dim"], TOY["out"], batch_seed)
    return {r: (TOY, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], extra)
            for r in range(n)}


def _whole(outcome: RunOutcome, case: int) -> tuple:
    import torch

    return (torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)]),
            torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)]))


def clip_reference(weights: dict, inputs, targets, max_norm: float) -> tuple[float, dict]:
    """(the gradients' total norm, {name: gradient clipped to max_norm}) of ToyModel on the whole batch, one process."""
    import torch

    model = _toy(weights)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _clip_label(outcome: RunOutcome, case: int) -> str:
    inputs, _ = _whole(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} (max_norm={outcome.inputs[case][0][4]:g}, batch of "
            f"{inputs.shape[0]} split over {outcome.nproc} ranks)")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


def _norm_judge(outcome: RunOutcome) -> list[str]:
    """clip returns the total norm of all gradients (every rank's shards together) on every rank."""
    for case, by_rank in enumerate(outcome.results):
        weights, max_norm = outcome.inputs[case][0][1], outcome.inputs[case][0][4]
        expected, _ = clip_reference(weights, *_whole(outcome, case), max_norm)
        local = {rank: result.output["local_norm"] for rank, result in by_rank.items()}
        for rank, result in sorted(by_rank.items()):
            got = result.output["norm"]
            where = f"rank {rank}, {_clip_label(outcome, case)}"
            if not isinstance(got, float):
                return [f"{where}: clip returned a {got}, expected the total norm (a number or a one-element tensor)"]
            if _close(got, expected):
                continue
            hint = ""
            if _close(got, local[rank]):
                hint = (": that is the norm of this rank's shard only (torch.nn.utils.clip_grad_norm_ over "
                        "model.parameters() sees the local FlatParameter shards); use model.clip_grad_norm_"
                        "(max_norm), which all-reduces the squares of every rank's shard")
            elif _close(got, sum(local.values())):
                hint = (": that is the sum of the ranks' shard norms; all-reduce the sum of squares, then take "
                        "the square root")
            elif _close(got, expected ** 2):
                hint = ": that is the square of the norm; take the square root of the all-reduced sum of squares"
            return [f"{where}: the norm is {got:.6g}, expected {expected:.6g} (all gradients, every rank's shard)"
                    f"{hint}"]
    return []


def _grads_judge(outcome: RunOutcome) -> list[str]:
    """Each rank's shard of every FlatParameter's gradient equals its slice of one process's clipped gradients."""
    for case, by_rank in enumerate(outcome.results):
        weights, max_norm = outcome.inputs[case][0][1], outcome.inputs[case][0][4]
        norm, expected = clip_reference(weights, *_whole(outcome, case), max_norm)
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_clip_label(outcome, case)}"
            for flat in result.output["flats"]:
                grad = flat["grad"]
                if grad is None:
                    return [f"{where}: {flat['name']} has no gradient afterwards"]
                starts = {name: start for name, start, _ in flat["layout"] if name is not None}
                for name, first, last in flat["pieces"]:
                    at = starts[name] + first - flat["shard_start"]
                    want = expected[name].flatten()[first:last]
                    wrong = first_difference(grad[at:at + last - first], want, rtol=RTOL, atol=ATOL)
                    if wrong:
                        hint = ""
                        if norm > max_norm and result.output["norm"] != norm:
                            hint = (f": clipped by another norm than the total, {norm:.6g} (each rank must scale "
                                    f"by max_norm / total norm)")
                        return [f"{where}: this rank's shard of {name}'s gradient (elements {first} to {last - 1}) "
                                f"{wrong}{hint}"]
    return []


CLIP = Exercise(
    id="04.clip_grad_norm",
    function="clip",
    signature="clip(model: FullyShardedDataParallel, max_norm: float) -> torch.Tensor",
    driver="fsdp_clip",
    allowed_ops=FSDP1_OPS | {"all_reduce"},
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_toy_case(n, 43, 4, 143, 0.5)],
                (Item("returns the total gradient norm on every rank (2 ranks)", 1, _norm_judge),
                 Item("every rank's gradient shards are clipped by it (2 ranks)", 1, _grads_judge)), timeout_s=10),
        RunSpec(3, lambda n: [_toy_case(n, 44, 2, 144, 0.3), _toy_case(n, 45, 2, 145, 100.0)],
                (Item("returns the total gradient norm on every rank (3 ranks, clipped and not)", 1, _norm_judge),
                 Item("every rank's gradient shards are clipped by it (3 ranks, clipped and not)", 1,
                      _grads_judge)), timeout_s=10),
    ),
)


# ---------------------------------------------------------------- 04.full_state_dict


def _save_case(n: int, weights_seed: int, steps: int, rows: int, batch_seed: int, index: int) -> dict[int, tuple]:
    from ....models import ToyModel

    weights = _weights(lambda: ToyModel(**TOY), weights_seed)
    inputs, targets = _batch(steps * n * rows, TOY["dim"], TOY["out"], batch_seed)
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
        expected = sgd_reference(_toy(weights), whole, lr)
        got = {name: p.detach() for name, p in model.named_parameters()}
        wrong = _compare_params(got, expected, f"rank 0, {_save_label(outcome, case)}: the saved")
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
                        "written; save on rank 0 only (if dist.get_rank() == 0)"]
            return [f"{where}: this rank saved a file too (keys: {', '.join(described.get('keys', [])[:3]) or '?'}"
                    "...); save on rank 0 only (if dist.get_rank() == 0): ranks writing one path overwrite "
                    "each other"]
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
                 Item("no other rank writes a file (2 ranks)", 1, _rank_0_only)), timeout_s=10),
        RunSpec(3, lambda n: [_save_case(n, 47, 1, 2, 147, 1)],
                (Item("its parameters equal one process's after 1 SGD step on the whole batch (3 ranks)", 1,
                      _saved_equal),), timeout_s=10),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (WRAP_POLICY, FLAT_SHARD, CLIP, FULL_STATE_DICT)}
