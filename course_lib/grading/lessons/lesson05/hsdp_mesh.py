"""05.hsdp_mesh: HSDP, `fully_shard` over a 2-D mesh: shard within groups of consecutive ranks (a node),
replicate across them.

The learner builds the mesh (named dims), shards ToyModel bottom up over it and returns the mesh. Judged: the
mesh and every parameter's placements per named dim (Replicate() over "replicate", Shard(dim=0) over
"shard", the shard groups consecutive ranks); the ledger per mesh dim in one training step (all-gathers and
reduce-scatters within the shard group, one all-reduce per FSDP group across the replicate group); the shards
after the steps against one process on the whole batch. The usual mistakes are named: the dims' names
swapped (fully_shard replicates over dim 0 whatever it is called), a 1-D mesh of every rank (FSDP, not HSDP).
"""

from __future__ import annotations

from ....theory import fsdp2_step_collectives
from ....vocabulary import data_flow
from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import FSDP2_OPS, FSDP2_PRELOAD, LR, TOY_2, batch, rows_text, rows_wrong, sgd_reference, toy, toy_weights

__all__ = ["HSDP_MESH", "HSDP_OPS", "shard_group", "replicate_group"]

STEPS = 2
HSDP_OPS = FSDP2_OPS | {"all_reduce"}  # HSDP all-reduces each group's gradient shard across the replicas

HINTS = (
    "Reread lesson 05, section 8 'Accumulation, clipping, HSDP', the part on HSDP and its 2-D mesh, and "
    "section 3 for sharding bottom up.",
    "init_device_mesh(device_type, mesh_shape, mesh_dim_names=...) and fully_shard(module, mesh=...) with a 2-D mesh.",
    "Lay the ranks out as a grid whose rows are the groups that share the shards (consecutive ranks) and whose "
    "columns hold the replicas; fully_shard replicates over the grid's first dim and shards over its second, so "
    "order and name the dims that way; shard each Block, then the root, over the whole grid.",
)


def shard_group(rank: int, shard_size: int) -> list[int]:
    """The consecutive ranks that share `rank`'s shards: its node of `shard_size` ranks."""
    first = rank - rank % shard_size
    return list(range(first, first + shard_size))


def replicate_group(rank: int, shard_size: int, world_size: int) -> list[int]:
    """The ranks that hold the same shard as `rank`, one per node."""
    return list(range(rank % shard_size, world_size, shard_size))


def _case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int, shard_size: int) -> dict[int, tuple]:
    weights = toy_weights(sizes, weights_seed)
    inputs, targets = batch(n * rows, sizes["dim"], sizes["out"], batch_seed)
    return {r: (sizes, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR, shard_size,
                STEPS) for r in range(n)}


def _label(outcome: RunOutcome, case: int) -> str:
    sizes, _, inputs, _, _, shard_size, _ = outcome.inputs[case][0]
    return (f"case {case + 1} of {len(outcome.inputs)} (ToyModel with {sizes['layers']} Blocks, shard groups of "
            f"{shard_size} ranks, {rows_text(inputs.shape[0])} per rank)")


def _returned(outcome: RunOutcome) -> list[str]:
    for case, rank, result in each_result(outcome):
        if "returned" in result.output:
            return [f"rank {rank}, {_label(outcome, case)}: shard_hsdp returned a {result.output['returned']}, "
                    "expected the DeviceMesh it sharded the model over"]
    return []


def _group(ranks: list[int]) -> str:
    return "ranks " + ",".join(map(str, ranks))


def _placed(outcome: RunOutcome) -> list[str]:
    """A 2-D mesh with dims named "replicate" and "shard", the shard groups consecutive ranks; every Block and
    the root FSDP modules; every parameter Replicate() over "replicate" and Shard(dim=0) over "shard"."""
    problem = _returned(outcome)
    if problem:
        return problem
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        sizes, shard_size = outcome.inputs[case][0][0], outcome.inputs[case][0][5]
        replicas = n // shard_size
        for rank, result in sorted(by_rank.items()):
            where = f"rank {rank}, {_label(outcome, case)}"
            mesh = result.output["mesh"]
            should = (f"HSDP needs a 2-D mesh of {replicas} x {shard_size} ranks: {shard_size} consecutive ranks "
                      f"share the shards ({_group(shard_group(rank, shard_size))} for this rank), and the "
                      f"{replicas} groups replicate them ({_group(replicate_group(rank, shard_size, n))})")
            if len(mesh["shape"]) != 2:
                return [f"{where}: the mesh is {len(mesh['shape'])}-D, shape {tuple(mesh['shape'])}: every parameter "
                        f"is sharded over all its {n} ranks, which is FSDP, not HSDP; {should}"]
            if sorted(mesh["names"]) != ["replicate", "shard"]:
                return [f"{where}: the mesh's dims are named {tuple(mesh['names']) or 'nothing'}, expected "
                        "'replicate' and 'shard' (mesh_dim_names), each the dim that does what it says"]
            expected_units = [""] + [f"blocks.{i}" for i in range(sizes["layers"])]
            if result.output["units"] != expected_units:
                return [f"{where}: the FSDP modules are {result.output['units']}, expected {expected_units}: shard "
                        "each Block, then the root, over the 2-D mesh"]
            named = dict(zip(mesh["names"], range(2)))
            for name, described in result.output["params"].items():
                if described["type"] != "DTensor":
                    return [f"{where}: {name} is a {described['type']}, not a DTensor: fully_shard did not shard it"]
                if described["mesh_names"] != mesh["names"]:
                    return [f"{where}: {name} is placed over a mesh with dims {tuple(described['mesh_names'])}, not "
                            "over the mesh returned"]
                on = {dim: described["placements"][index] for dim, index in named.items()}
                if on == {"replicate": "Shard(dim=0)", "shard": "Replicate()"}:
                    return [f"{where}: {name} is Replicate() over the dim you named 'shard' (dim "
                            f"{named['shard']}) and Shard(dim=0) over 'replicate' (dim {named['replicate']}): "
                            "fully_shard on a 2-D mesh replicates over dim 0 and shards over dim 1, whatever their "
                            "names, so the names say the opposite of what each dim does"]
                if on != {"replicate": "Replicate()", "shard": "Shard(dim=0)"}:
                    return [f"{where}: {name} has placements {tuple(described['placements'])} over dims "
                            f"{tuple(mesh['names'])}, expected Replicate() over 'replicate' and Shard(dim=0) over "
                            "'shard'"]
            if mesh["groups"][named["shard"]] != shard_group(rank, shard_size):
                return [f"{where}: the dim named 'shard' groups {_group(mesh['groups'][named['shard']])}, expected "
                        f"{_group(shard_group(rank, shard_size))}: {should}"]
    return []


def _expected_ledger(sizes: dict, weights: dict, rank: int, shard_size: int, n: int) -> dict:
    """{(data flow, group): calls} of one step: FSDP2's all-gathers and reduce-scatters within the shard group
    (cl.theory's step on `shard_size` ranks), one all-reduce per FSDP group within the replicate group."""
    units = [[tuple(v.shape) for k, v in weights.items() if k.startswith(f"blocks.{i}.")]
             for i in range(sizes["layers"])]
    units.append([tuple(v.shape) for k, v in weights.items() if k.startswith("head.")])
    shard, replicate = _group(shard_group(rank, shard_size)), _group(replicate_group(rank, shard_size, n))
    expected: dict = {}
    for op, _ in fsdp2_step_collectives(units, shard_size):
        key = (data_flow(op), shard)
        expected[key] = expected.get(key, 0) + 1
    expected[("all_reduce", replicate)] = len(units)
    return expected


def _shown(counts: dict) -> str:
    return ", ".join(f"{count} {flow.replace('_', '-')}s in {group}" for (flow, group), count in sorted(counts.items()))


def _per_dim(outcome: RunOutcome) -> list[str]:
    """The ledger of the last step: all-gathers and reduce-scatters in the shard group, all-reduces in the
    replicate group, as many as FSDP2's step and one all-reduce per FSDP group."""
    problem = _returned(outcome)
    if problem:
        return problem
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, _, _, shard_size, _ = outcome.inputs[case][0]
        for rank, result in sorted(by_rank.items()):
            start, stop = result.output["steps"][-1]
            got: dict = {}
            for e in result.ledger:
                if start <= e["start"] <= stop:
                    key = (data_flow(e["op"]), e["group"].replace("world", _group(list(range(n)))))
                    got[key] = got.get(key, 0) + 1
            expected = _expected_ledger(sizes, weights, rank, shard_size, n)
            if got == expected:
                continue
            where = f"rank {rank}, {_label(outcome, case)}, the last training step"
            hint = ""
            groups = {group for _, group in got}
            if groups == {_group(list(range(n)))}:
                hint = (f": every collective runs over all {n} ranks and none across replicas, as on a 1-D mesh; "
                        "HSDP gathers and reduce-scatters within the shard group only, then all-reduces each "
                        "gradient shard across the replicas")
            return [f"{where}: the ledger shows {_shown(got) or 'no collective'}, expected {_shown(expected)}{hint}"]
    return []


def _trained(outcome: RunOutcome) -> list[str]:
    """After the steps each rank's rows of every parameter (the piece its coordinate on the sharding dim names)
    equal one process's SGD steps on the whole batch."""
    import torch

    problem = _returned(outcome)
    if problem:
        return problem
    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, _, lr, _, steps = outcome.inputs[case][0]
        inputs = torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)])
        targets = torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)])
        expected = sgd_reference(toy(sizes, weights), [(inputs, targets)] * steps, lr)
        for rank, result in sorted(by_rank.items()):
            for name, full in expected.items():
                described = result.output["params"][name]
                dims = [d for d, p in enumerate(described.get("placements", [])) if p == "Shard(dim=0)"]
                pieces, index = (1, 0) if not dims else (described["mesh_shape"][dims[0]],
                                                         described["coordinate"][dims[0]])
                wrong = rows_wrong(result.output["shards"][name], full, rank, pieces, name, index=index)
                if wrong:
                    return [f"rank {rank}, {_label(outcome, case)}: after {steps} SGD steps {wrong}"]
    return []


HSDP_MESH = Exercise(
    id="05.hsdp_mesh",
    hints=HINTS,
    function="shard_hsdp",
    signature="shard_hsdp(model: ToyModel, shard_size: int) -> DeviceMesh",
    driver="fsdp2_hsdp",
    allowed_ops=HSDP_OPS,
    preload=FSDP2_PRELOAD,
    runs=(
        RunSpec(4, lambda n: [_case(n, TOY_2, 59, 2, 159, 2)],
                (Item("a 2 x 2 mesh: Replicate() over 'replicate', Shard(0) over 'shard', shard groups of "
                      "consecutive ranks", 1, _placed),
                 Item("per mesh dim: all-gathers and reduce-scatters in the shard group, all-reduces across "
                      "the replicas", 1, _per_dim),
                 Item(f"{STEPS} SGD steps equal one process on the whole batch", 1, _trained)), timeout_s=10),
    ),
)
