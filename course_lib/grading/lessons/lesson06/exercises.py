"""Lesson 06's exercises: Megatron's MLP by hand (megatron_mlp), a TP plan for an attention block
(attention_plan), FSDP2 x TP on a 2-D mesh (mesh_2d). Specs, inputs, one process's references and the
judges: the checker's side; what runs on the ranks is in `drivers`.

References are one process, computed here without torch.distributed, from weights drawn from fixed seeds.
"""

from __future__ import annotations

from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from ..lesson04.common import ATOL, LR, RTOL, draw_batch, draw_weights, sgd_reference

__all__ = ["ATTENTION_PLAN", "ATOL", "EXERCISES", "MEGATRON_MLP", "MESH_2D", "RTOL", "TOY_TP", "TP_PRELOAD"]

TP_PRELOAD = ("torch._dynamo", "torch.distributed.tensor.parallel", "torch.distributed.fsdp")
# parallelize_module places each weight with distribute_tensor: rank 0's copy scattered (dist.scatter) or
# broadcast; its own collectives (functional ones) do not pass through torch.distributed's Python calls.
TP_OPS = frozenset({"scatter", "broadcast"})
FSDP2_OPS = frozenset({"all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single"})
TOY_TP = {"dim": 8, "hidden": 16, "layers": 2, "out": 4}  # hidden divides by 2 and 4
MLP_DIM, MLP_HIDDEN = 8, 16
ATTN_DIM, ATTN_HEADS, SEQ = 16, 4, 6
STEPS = 2


def _where(rank: int, case: int, outcome: RunOutcome) -> str:
    return f"rank {rank}, case {case + 1} of {len(outcome.inputs)} ({outcome.nproc} ranks)"


def _returned_problem(outcome: RunOutcome) -> list[str]:
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            if "returned" in result.output and "out" not in result.output and "mesh" not in result.output:
                return [f"{_where(rank, case, outcome)}: got a {result.output['returned']}, expected an nn.Module"]
    return []


# ------------------------------------------------------------------ 06.megatron_mlp

MLP_HINTS = (
    "Reread lesson 06, section 3 'Megatron's tensor-parallel MLP, by hand' (the f and g operators).",
    "torch.autograd.Function (forward/backward as static methods, .apply) and dist.all_reduce.",
    "Keep up's rows and down's columns of this rank's hidden units; one function that is the identity going "
    "forward and sums the gradient coming back, at the input; one that sums the output terms going forward and "
    "passes the gradient through, after the row-parallel product; the whole down bias added after the sum.",
)


def _mlp_weights(seed: int) -> dict:
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(MLP_DIM, MLP_HIDDEN), torch.nn.GELU(),
                                   torch.nn.Linear(MLP_HIDDEN, MLP_DIM))
    return draw_weights(build, seed)


def _mlp_case(n: int, seed: int, rows: int) -> dict[int, tuple]:
    weights = _mlp_weights(seed)
    inputs, _ = draw_batch(rows, MLP_DIM, 1, seed + 100)
    return {r: (weights, inputs) for r in range(n)}


def _mlp_reference(weights: dict, inputs) -> dict:
    from .drivers import mlp_from_weights

    mlp = mlp_from_weights(weights)
    x = inputs.clone().requires_grad_()
    out = mlp(x)
    out.sum().backward()
    return {"out": out.detach(), "x.grad": x.grad, **{n: p.grad for n, p in mlp.named_parameters()}}


def _slices(rank: int, n: int) -> dict:
    h = MLP_HIDDEN // n
    rows = slice(rank * h, (rank + 1) * h)
    return {"up_weight": ("0.weight", (rows,)), "up_bias": ("0.bias", (rows,)),
            "down_weight": ("2.weight", (slice(None), rows)), "down_bias": ("2.bias", ())}


def _mlp_held(outcome: RunOutcome) -> list[str]:
    problem = _returned_problem(outcome)
    if problem:
        return problem
    n, h = outcome.nproc, MLP_HIDDEN // outcome.nproc
    expected = {"up_weight": [h, MLP_DIM], "up_bias": [h], "down_weight": [MLP_DIM, h], "down_bias": [MLP_DIM]}
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            got = result.output["params"]
            if got != expected:
                shown = ", ".join(f"{k} {v}" for k, v in got.items()) or "none"
                return [f"{_where(rank, case, outcome)}: TPMLP holds the parameters {shown}; expected exactly "
                        + ", ".join(f"{k} {v}" for k, v in expected.items())
                        + f": this rank's {h} of the {MLP_HIDDEN} hidden units (up's rows, down's columns) and "
                        "down's whole bias"]
    return []


def _mlp_output(outcome: RunOutcome) -> list[str]:
    import torch

    problem = _mlp_held(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        weights, inputs = outcome.inputs[case][0]
        ref = _mlp_reference(weights, inputs)
        for rank, result in sorted(by_rank.items()):
            wrong = first_difference(result.output["out"], ref["out"], rtol=RTOL, atol=ATOL)
            if not wrong:
                continue
            hint = ""
            counts = _all_reduces(result)
            if counts[0] > 1:
                hint = (f"; the forward all-reduced {counts[0]} times: summing the column-parallel layer's output "
                        "adds different hidden units together; only the row-parallel layer's terms are summed")
            return [f"{_where(rank, case, outcome)}: the output {wrong}{hint}"]
    return []


def _all_reduces(result) -> tuple[int, int]:
    forward, backward = result.output["forward"], result.output["backward"]
    f = sum(1 for e in result.ledger if e["op"] == "all_reduce" and forward[0] <= e["start"] <= forward[1])
    b = sum(1 for e in result.ledger if e["op"] == "all_reduce" and backward[0] <= e["start"] <= backward[1])
    return f, b


def _mlp_grads(outcome: RunOutcome) -> list[str]:
    import torch

    problem = _mlp_held(outcome)
    if problem:
        return problem
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights, inputs = outcome.inputs[case][0]
        ref = _mlp_reference(weights, inputs)
        for rank, result in sorted(by_rank.items()):
            where = _where(rank, case, outcome)
            got = result.output["x.grad"]
            wrong = first_difference(got, ref["x.grad"], rtol=RTOL, atol=ATOL)
            if wrong:
                hint = ""
                if isinstance(got, torch.Tensor) and _all_reduces(result)[1] == 0:
                    hint = ("; backward all-reduced nothing: each rank's gradient of x comes from its own hidden "
                            "units only, a term of the whole gradient; the ranks' terms must be summed (f)")
                return [f"{where}: the gradient of the input {wrong}{hint}"]
            for name, (full, index) in _slices(rank, n).items():
                wrong = first_difference(result.output["grads"].get(name), ref[full][index], rtol=RTOL, atol=ATOL)
                if wrong:
                    return [f"{where}: the gradient of {name} (this rank's part of {full}) {wrong}"]
    return []


def _mlp_ledger(outcome: RunOutcome) -> list[str]:
    problem = _mlp_held(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            f, b = _all_reduces(result)
            if (f, b) != (1, 1):
                return [f"{_where(rank, case, outcome)}: the ledger shows {f} all-reduce(s) in forward and {b} in "
                        "backward, expected exactly 1 and 1: g after the row-parallel layer in forward, f at the "
                        "input in backward"]
    return []


MEGATRON_MLP = Exercise(
    id="06.megatron_mlp",
    hints=MLP_HINTS,
    function="TPMLP",
    signature="TPMLP(up: nn.Linear, down: nn.Linear) -> nn.Module",
    driver="megatron_mlp",
    allowed_ops=frozenset({"all_reduce"}),
    runs=tuple(
        RunSpec(n, (lambda n, s=seed: [_mlp_case(n, s, 4)]),
                (Item(f"output equals one process ({n} ranks)", 1, _mlp_output),
                 Item(f"gradients of the input and of each shard equal one process ({n} ranks)", 1, _mlp_grads),
                 Item(f"one all-reduce in forward, one in backward ({n} ranks)", 1, _mlp_ledger)), timeout_s=15)
        for n, seed in ((2, 61), (4, 62))),  # 15 s: a 2-rank run passed 10 s once at a load average of 21
)

# ------------------------------------------------------------------ 06.attention_plan

ATTENTION_HINTS = (
    "Reread lesson 06, section 3's 'Attention by heads', and section 4's plans.",
    "parallelize_module(module, mesh, {name: ColwiseParallel() or RowwiseParallel()}).",
    "The three input projections give each rank whole heads (their output features), the output projection "
    "takes those heads back (its input features) and sums the ranks' terms; the module then has fewer heads "
    "per rank than it was built with, and must be told so.",
)


def _attention_case(n: int, seed: int, batch: int) -> dict[int, tuple]:
    import torch

    from .drivers import Attention

    weights = draw_weights(lambda: Attention(ATTN_DIM, ATTN_HEADS), seed)
    inputs = torch.randn(batch, SEQ, ATTN_DIM, generator=torch.Generator().manual_seed(seed + 100))
    return {r: (ATTN_DIM, ATTN_HEADS, weights, inputs) for r in range(n)}


def _attention_reference(weights: dict, inputs) -> dict:
    from .drivers import Attention

    attention = Attention(ATTN_DIM, ATTN_HEADS)
    attention.load_state_dict(weights)
    x = inputs.clone().requires_grad_()
    out = attention(x)
    out.sum().backward()
    return {"out": out.detach(), "x.grad": x.grad, "grads": {n: p.grad for n, p in attention.named_parameters()}}


EXPECTED_PLACEMENTS = {"q.weight": ["Shard(dim=0)"], "k.weight": ["Shard(dim=0)"], "v.weight": ["Shard(dim=0)"],
                       "o.weight": ["Shard(dim=1)"]}


def _attention_placed(outcome: RunOutcome) -> list[str]:
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            where = _where(rank, case, outcome)
            for name, want in EXPECTED_PLACEMENTS.items():
                got = result.output["params"][name]["placements"]
                if got != want:
                    why = ("q, k and v are column-parallel (each rank: whole heads, rows of the [out, in] weight), "
                           "o row-parallel (the same heads' columns)")
                    return [f"{where}: {name} has placements {got}, expected {want}: {why}"]
            heads = result.output["n_heads"]
            if heads != ATTN_HEADS // n:
                return [f"{where}: the module splits its q into n_heads={heads} heads, expected {ATTN_HEADS // n}: "
                        f"each of the {n} ranks computes {ATTN_HEADS} / {n} heads"]
    return []


def _attention_equal(outcome: RunOutcome) -> list[str]:
    problem = _attention_placed(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        _, _, weights, inputs = outcome.inputs[case][0]
        ref = _attention_reference(weights, inputs)
        for rank, result in sorted(by_rank.items()):
            where = _where(rank, case, outcome)
            if "error" in result.output:
                return [f"{where}: the forward or backward raised {result.output['error']}"]
            for label, got, want in (("the output", result.output["out"], ref["out"]),
                                     ("the gradient of the input", result.output["x.grad"], ref["x.grad"])):
                wrong = first_difference(got, want, rtol=RTOL, atol=ATOL)
                if wrong:
                    return [f"{where}: {label} {wrong}"]
            for name, want in ref["grads"].items():
                wrong = first_difference(result.output["grads"].get(name), want, rtol=RTOL, atol=ATOL)
                if wrong:
                    return [f"{where}: the gradient of {name} {wrong}"]
    return []


def _attention_comm(outcome: RunOutcome) -> list[str]:
    problem = _attention_placed(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            if "error" in result.output:
                return [f"{_where(rank, case, outcome)}: the forward or backward raised {result.output['error']}"]
            if result.output["forward"] != {"all_reduce": 1}:
                return [f"{_where(rank, case, outcome)}: the forward issued {result.output['forward'] or 'nothing'} "
                        "(CommDebugMode), expected one all_reduce: the output projection's terms, summed once"]
    return []


ATTENTION_PLAN = Exercise(
    id="06.attention_plan",
    hints=ATTENTION_HINTS,
    function="parallelize_attention",
    signature="parallelize_attention(attention: Attention, mesh: DeviceMesh) -> None",
    driver="attention_plan",
    allowed_ops=TP_OPS,
    preload=TP_PRELOAD,
    runs=tuple(
        RunSpec(n, (lambda n, s=seed: [_attention_case(n, s, 2)]),
                (Item(f"q, k, v Shard(0), o Shard(1), {ATTN_HEADS // n} of the {ATTN_HEADS} heads per rank ({n} ranks)", 1,
                      _attention_placed),
                 Item(f"output and gradients equal one process ({n} ranks)", 1, _attention_equal),
                 Item(f"one all-reduce in forward ({n} ranks)", 1, _attention_comm)), timeout_s=15)
        for n, seed in ((2, 71), (4, 72))),
)

# ------------------------------------------------------------------ 06.mesh_2d

MESH_HINTS = (
    "Reread lesson 06, section 6 '2-D: FSDP2 over dp x TP over tp'.",
    "init_device_mesh(device_type, shape, mesh_dim_names=...), mesh['name'], parallelize_module and "
    "fully_shard(module, mesh=...).",
    "Lay the ranks out so that each tp group is consecutive ranks; tensor-parallelize each Block over the tp "
    "sub-mesh first, then shard each Block and the root over the dp sub-mesh.",
)


def _toy_weights(seed: int) -> dict:
    from ....models import ToyModel

    return draw_weights(lambda: ToyModel(**TOY_TP), seed)


def _mesh_case(n: int, seed: int, rows: int, tp_size: int) -> dict[int, tuple]:
    weights = _toy_weights(seed)
    inputs, targets = draw_batch(rows, TOY_TP["dim"], TOY_TP["out"], seed + 100)
    return {r: (TOY_TP, weights, inputs, targets, LR, tp_size, STEPS) for r in range(n)}


def _mesh_placed(outcome: RunOutcome) -> list[str]:
    problem = _returned_problem(outcome)
    if problem:
        return problem
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        tp = outcome.inputs[case][0][5]
        for rank, result in sorted(by_rank.items()):
            where = _where(rank, case, outcome)
            mesh = result.output["mesh"]
            if mesh["names"] != ["dp", "tp"] or mesh["shape"] != [n // tp, tp]:
                return [f"{where}: the mesh has shape {mesh['shape']} and dims {mesh['names']}, expected "
                        f"[{n // tp}, {tp}] named ['dp', 'tp']"]
            first = rank - rank % tp
            if mesh["groups"][1] != list(range(first, first + tp)):
                return [f"{where}: the tp group is ranks {mesh['groups'][1]}, expected the consecutive ranks "
                        f"{list(range(first, first + tp))} (one node's)"]
            for name, described in result.output["params"].items():
                placements = described["placements"]
                if placements is None:
                    return [f"{where}: {name} is not a DTensor: neither TP nor FSDP placed it"]
                is_tp = name.startswith("blocks.") and name.endswith(("up.weight", "up.bias", "down.weight"))
                if described["mesh_names"] != ["dp", "tp"] and is_tp:
                    swapped = (": FSDP sharded it over tp and TP split it over dp, the sub-meshes swapped"
                               if described["mesh_names"] == ["tp", "dp"] else "")
                    return [f"{where}: {name} is placed over dims {described['mesh_names']}, expected both "
                            f"('dp', 'tp'): tensor-parallel over tp, then sharded by FSDP over dp{swapped}"]
                tp_placement = placements[-1] if is_tp else None
                want = ("Shard(dim=0)" if name.endswith("up.weight") or name.endswith("up.bias")
                        else "Shard(dim=1)") if is_tp else None
                if is_tp and tp_placement != want:
                    hint = ""
                    if "Shard(dim=0)" in placements[-1] and name.endswith("down.weight"):
                        hint = ": is FSDP sharding over tp? fully_shard goes over the dp sub-mesh"
                    return [f"{where}: {name} has placements {placements} over ('dp', 'tp'), expected {want} over "
                            f"tp{hint}"]
                if is_tp and "Shard" not in placements[0]:
                    return [f"{where}: {name} has placements {placements}: not sharded over dp; fully_shard each "
                            "Block and the root over mesh['dp']"]
                if not is_tp and ("Shard" not in placements[0] or described["mesh_names"][0] != "dp"):
                    return [f"{where}: {name} (not tensor-parallel) has placements {placements} over "
                            f"{described['mesh_names']}, expected Shard(dim=0) over dp (FSDP's)"]
    return []


def _mesh_ledger(outcome: RunOutcome) -> list[str]:
    problem = _mesh_placed(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        tp = outcome.inputs[case][0][5]
        for rank, result in sorted(by_rank.items()):
            start, stop = result.output["steps"][-1]
            dp_group = "ranks " + ",".join(map(str, range(rank % tp, outcome.nproc, tp)))
            groups = {e["group"] for e in result.ledger if start <= e["start"] <= stop and e["op"] in FSDP2_OPS}
            if groups != {dp_group}:
                return [f"{_where(rank, case, outcome)}: FSDP's all-gathers and reduce-scatters in the last step ran "
                        f"over {sorted(groups) or 'no group'}, expected only the dp group ({dp_group})"]
    return []


def _mesh_trained(outcome: RunOutcome) -> list[str]:
    from .drivers import toy_from_weights

    problem = _mesh_placed(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        sizes, weights, inputs, targets, lr, _, steps = outcome.inputs[case][0]
        expected = sgd_reference(toy_from_weights(sizes, weights), [(inputs, targets)] * steps, lr)
        for rank, result in sorted(by_rank.items()):
            for name, want in expected.items():
                wrong = first_difference(result.output["whole"][name], want, rtol=RTOL, atol=ATOL)
                if wrong:
                    return [f"{_where(rank, case, outcome)}: after {steps} SGD steps {name} {wrong}"]
    return []


MESH_2D = Exercise(
    id="06.mesh_2d",
    hints=MESH_HINTS,
    function="parallelize_2d",
    signature="parallelize_2d(model: ToyModel, tp_size: int) -> DeviceMesh",
    driver="mesh_2d",
    allowed_ops=TP_OPS | FSDP2_OPS,
    preload=TP_PRELOAD,
    runs=(
        RunSpec(4, lambda n: [_mesh_case(n, 81, 8, 2)],
                (Item("a 2 x 2 mesh ('dp', 'tp'): each Block's Linears TP over tp and sharded over dp", 1,
                      _mesh_placed),
                 Item("FSDP's collectives within the dp group only", 1, _mesh_ledger),
                 Item(f"{STEPS} SGD steps equal one process on the whole batch", 1, _mesh_trained)), timeout_s=20),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (MEGATRON_MLP, ATTENTION_PLAN, MESH_2D)}
