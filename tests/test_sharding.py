"""course_lib.measure.sharding / sharding_draw: who holds which slice, on real gloo ranks, against theory.py.

One torchrun launch per world size (2 and 4) wraps `toy_model()` with every
strategy in turn (DDP, FSDP1, FSDP2; at 4 ranks also TP and FSDP2+TP on a
("dp", "tp") = (2, 2) mesh) and publishes `sharding_of(model)` for each, plus
whether each rank's reported block really holds those values of the model.
Expected layouts come from `course_lib.theory`, computed from the model's shapes.
"""

import gc
import math
import warnings

import pytest

from course_lib import theory
from course_lib.draw.figures import overflow_inches, png_bytes
from course_lib.models import toy_model
from course_lib.measure.sharding import check_sharding, clean_name, sharding_of
from course_lib.draw.sharding import draw_mesh, show_sharding
from course_lib.launcher.torchrun import run_torchrun

SCRIPT = """
import contextlib, io
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import visualize_sharding
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
import course_lib as cl
from course_lib.models import Block, toy_model
from course_lib.measure.sharding import clean_name, sharding_of

info = cl.init(timeout_s=60)
n = info.world_size
reference = {name: p.detach() for name, p in toy_model().named_parameters()}

def wrong_values(model, data):
    # Names whose reported block does not hold the model's values there.
    bad = []
    if data["flat"]:  # FSDP1: each piece sits in the local shard at its layout start + first - shard_start
        flats = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle]
        for f, local in zip(data["flat"], flats):
            starts = {name: s for name, s, _ in f["layout"]}
            for name, first, last in f["pieces"]:
                at = starts[name] + first - f["shard_start"]
                if not torch.equal(local.detach()[at:at + last - first], reference[name].flatten()[first:last]):
                    bad.append(name)
        return bad
    params = {clean_name(k): v for k, v in getattr(model, "module", model).named_parameters()}  # DDP: .module
    for p in data["params"]:
        held = params[p["name"]]
        held = held.to_local() if isinstance(held, DTensor) else held
        block = tuple(slice(o, o + s) for o, s in zip(p["offset"], p["local_shape"]))
        if not torch.equal(held.detach(), reference[p["name"]][block]):
            bad.append(p["name"])
    return bad

def publish(name, model):
    data = sharding_of(model)
    cl.publish(name, data)
    cl.publish(name + "_wrong", wrong_values(model, data))

publish("ddp", DDP(toy_model()))
for orig in ([False, True] if n == 2 else [False]):
    publish(f"fsdp1_orig{orig}", FSDP(toy_model(), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                     device_id=torch.device("cpu"), use_orig_params=orig))
model = toy_model()
mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
publish("fsdp2", model)
if n == 4:
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    model = toy_model()
    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    for block in model.blocks:
        parallelize_module(block, tp, plan)
    publish("tp", model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        visualize_sharding(model.blocks[0].up.weight)
    cl.publish("torch_view", out.getvalue())

    model = toy_model()
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:  # TP first on the tp dim, then FSDP2 on the dp dim (torchtitan's order)
        parallelize_module(block, mesh2["tp"], plan)
        fully_shard(block, mesh=mesh2["dp"])
    fully_shard(model, mesh=mesh2["dp"])
    publish("twod", model)
dist.destroy_process_group()
"""

STRATEGIES = {2: ["ddp", "fsdp1_origFalse", "fsdp1_origTrue", "fsdp2"], 4: ["ddp", "fsdp1_origFalse", "fsdp2", "tp", "twod"]}
SHAPES = {name: tuple(p.shape) for name, p in toy_model().named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def run(request):
    result = run_torchrun(SCRIPT, request.param, timeout_s=240)
    assert result.ok, {r: result.stderr[r][-2000:] for r in result.stderr}
    return request.param, result.results


def test_every_strategy_is_recognised_and_tiles_each_parameter(run):
    n, results = run
    kinds = {"ddp": "ddp", "fsdp1_origFalse": "fsdp1", "fsdp1_origTrue": "fsdp1", "fsdp2": "fsdp2",
             "tp": "tp", "twod": "2d"}
    for strategy in STRATEGIES[n]:
        per_rank = results[strategy]
        assert sorted(per_rank) == list(range(n))
        assert {d["kind"] for d in per_rank.values()} == {kinds[strategy]}
        for rank, data in per_rank.items():
            assert {p["name"]: tuple(p["global_shape"]) for p in data["params"]} == SHAPES
        blocks = check_sharding(per_rank)
        for name, shape in SHAPES.items():  # distinct blocks add up to the parameter, once
            assert sum(math.prod(s) for _, s in blocks[name]) == math.prod(shape), (strategy, name)
        if strategy in ("fsdp1_origFalse", "fsdp1_origTrue", "fsdp2"):  # fully sharded: no replicas
            assert all(len(ranks) == 1 for name in SHAPES for ranks in blocks[name].values())
        if strategy == "ddp":
            assert all(blocks[name] == {((0,) * len(s), s): list(range(n))} for name, s in SHAPES.items())


def test_reported_blocks_hold_the_models_values(run):
    n, results = run
    for strategy in STRATEGIES[n]:
        assert results[f"{strategy}_wrong"] == {r: [] for r in range(n)}, strategy


def test_fsdp1_flat_shards_equal_theory(run):
    n, results = run
    for strategy in [s for s in STRATEGIES[n] if s.startswith("fsdp1")]:
        for rank, data in results[strategy].items():
            assert [f["name"] for f in data["flat"]] == ["_flat_param", "blocks.0._flat_param", "blocks.1._flat_param"]
            for f in data["flat"]:
                names = [name for name, _, _ in f["layout"] if name is not None]
                expected = theory.fsdp1_flat_shards([(k, math.prod(SHAPES[k])) for k in names], n,
                                                    use_orig_params=strategy.endswith("True"))[rank]
                got = (f["shard_start"], f["shard_end"], f["numel"], f["padding"], f["align_padding"], f["pieces"])
                assert got == (expected.start, expected.end, expected.numel, expected.padding,
                               expected.align_padding, expected.pieces), (strategy, rank, f["name"])
                assert f["shard_numel"] == expected.shard_numel


def test_fsdp1_use_orig_params_moves_the_boundary_on_2_ranks(run):
    """Measured: use_orig_params=True pads up.bias's end to 16 bytes, so rank 0 takes one more element."""
    n, results = run
    if n != 2:
        pytest.skip("compared on 2 ranks")
    plain = {f["name"]: f for f in results["fsdp1_origFalse"][0]["flat"]}
    orig = {f["name"]: f for f in results["fsdp1_origTrue"][0]["flat"]}
    assert (plain["blocks.0._flat_param"]["unsharded_numel"], orig["blocks.0._flat_param"]["unsharded_numel"]) == (229, 232)
    assert plain["blocks.0._flat_param"]["pieces"][-1] == ("blocks.0.up.bias", 0, 11)
    assert orig["blocks.0._flat_param"]["pieces"][-1] == ("blocks.0.up.bias", 0, 12)


def test_fsdp2_local_shapes_and_padding_equal_theory(run):
    n, results = run
    for rank, data in results["fsdp2"].items():
        assert data["mesh"] == {"shape": [n], "dim_names": ["dp"], "ranks": list(range(n))}
        for p in data["params"]:
            shape = tuple(p["global_shape"])
            assert p["placements"] == ["Shard(0)"]
            assert tuple(p["local_shape"]) == theory.fsdp2_local_shape(shape, n, rank), p["name"]
            assert p["padding"] == theory.fsdp2_padded_shard_numel(shape, n) - math.prod(p["local_shape"])
            assert p["offset"][0] == sum(theory.chunk_sizes(shape[0], n)[:rank])


def test_tp_colwise_up_is_shard0_rowwise_down_is_shard1(run):
    n, results = run
    if n != 4:
        pytest.skip("TP is launched on 4 ranks")
    expected = {"up.weight": ["Shard(0)"], "up.bias": ["Shard(0)"], "down.weight": ["Shard(1)"],
                "down.bias": ["Replicate()"]}
    for rank, data in results["tp"].items():
        params = {p["name"]: p for p in data["params"]}
        assert params["head.weight"]["placements"] == []  # not in the plan: a full copy per rank
        for i in range(2):
            for leaf, placements in expected.items():
                assert params[f"blocks.{i}.{leaf}"]["placements"] == placements
            rows = theory.chunk_sizes(13, 4)
            assert params[f"blocks.{i}.up.weight"]["local_shape"] == [rows[rank], 8]
            assert params[f"blocks.{i}.down.weight"]["local_shape"] == [8, rows[rank]]
            assert params[f"blocks.{i}.down.weight"]["offset"] == [0, sum(rows[:rank])]
    view = results["torch_view"]
    assert [view[r] for r in (1, 2, 3)] == ["", "", ""]
    for rows_text in ("Row 0-3", "Row 4-7", "Row 8-11", "Row 12-12", "cpu:3"):
        assert rows_text in view[0]  # torch prints every rank's block, on rank 0 only


def test_2d_mesh_ranks_and_blocks(run):
    n, results = run
    if n != 4:
        pytest.skip("2-D needs 4 ranks")
    per_rank = results["twod"]
    assert per_rank[0]["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"], "ranks": [[0, 1], [2, 3]]}
    for rank, data in per_rank.items():
        dp, tp = divmod(rank, 2)
        params = {p["name"]: p for p in data["params"]}
        # up.weight: TP takes tp's chunk of the 13 rows, then FSDP2 takes dp's chunk of that.
        tp_rows = theory.chunk_sizes(13, 2)
        dp_rows = theory.chunk_sizes(tp_rows[tp], 2)
        up = params["blocks.0.up.weight"]
        assert up["placements"] == ["_StridedShard(0, sf=2)", "Shard(0)"]
        assert (up["offset"], up["local_shape"]) == ([sum(tp_rows[:tp]) + sum(dp_rows[:dp]), 0], [dp_rows[dp], 8])
        down = params["blocks.0.down.weight"]
        assert down["placements"] == ["Shard(0)", "Shard(1)"]
        assert down["local_shape"] == [theory.chunk_sizes(8, 2)[dp], theory.chunk_sizes(13, 2)[tp]]
        assert params["blocks.0.down.bias"]["placements"] == ["Shard(0)", "Replicate()"]
    mesh = draw_mesh(per_rank, display=False)
    assert mesh.coords == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}


def test_show_sharding_and_draw_mesh_render_cleanly_and_return_their_input(run):
    n, results = run
    for strategy in STRATEGIES[n]:
        per_rank = results[strategy]
        with warnings.catch_warnings():
            gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
            warnings.simplefilter("error")
            view = show_sharding(per_rank, display=False)
            assert png_bytes(view.figure)[:4] == b"\x89PNG"
            mesh = draw_mesh(per_rank[0]["mesh"], display=False)
            assert png_bytes(mesh.figure)[:4] == b"\x89PNG"
        assert (view.kind, view.world_size, view.mesh) == (per_rank[0]["kind"], n, per_rank[0]["mesh"])
        for i, name in enumerate(SHAPES):
            entries = [per_rank[r]["params"][[p["name"] for p in per_rank[r]["params"]].index(name)] for r in range(n)]
            assert view.owners[name] == [(r, tuple(e["offset"]), tuple(e["local_shape"])) for r, e in enumerate(entries)]
            assert view.shapes[name] == SHAPES[name]
        assert view.flat == {f["name"]: [per_rank[r]["flat"][j] for r in range(n)]
                             for j, f in enumerate(per_rank[0]["flat"])}
        assert view.padding == {r: sum(f["padding"] + f["align_padding"] for f in per_rank[r]["flat"])
                                + sum(p["padding"] for p in per_rank[r]["params"]) for r in range(n)}
        assert view.table.splitlines()[0].startswith(f"{per_rank[0]['kind']} on {n} ranks")
        assert mesh.ranks == per_rank[0]["mesh"]["ranks"]
        assert sorted(mesh.coords) == list(range(n))


# ---------------------------------------------------------------- single process, fast


def _param(name, offset, shape, global_shape, **extra):
    return {"name": name, "global_shape": list(global_shape), "local_shape": list(shape), "offset": list(offset),
            "placements": ["Shard(0)"], "mesh_dims": ["dp"], "flattened": False, "dtype": "float32",
            "local_bytes": 4 * math.prod(shape), "padding": 0, **extra}


def _two_ranks(second_offset, second_shape, global_shape=(4, 3)):
    mesh = {"shape": [2], "dim_names": ["dp"], "ranks": [0, 1]}
    return {r: {"rank": r, "world_size": 2, "kind": "fsdp2", "mesh": mesh, "flat": [],
                "params": [_param("w", *((0, 0), (2, 3)) if r == 0 else (second_offset, second_shape), global_shape)]}
            for r in range(2)}


def test_check_sharding_accepts_a_tiling_and_replicas():
    assert check_sharding(_two_ranks((2, 0), (2, 3))) == {"w": {((0, 0), (2, 3)): [0], ((2, 0), (2, 3)): [1]}}
    assert check_sharding(_two_ranks((0, 0), (2, 3), (2, 3))) == {"w": {((0, 0), (2, 3)): [0, 1]}}


@pytest.mark.parametrize("second, message", [
    (((1, 0), (2, 3)), "both hold"),            # overlaps rank 0's rows 0-1
    (((2, 0), (1, 3)), "on no rank"),           # row 3 is on no rank
    (((3, 0), (2, 3)), "outside"),              # rows 3-4 of a 4-row parameter
    (((2, 0), (2, 2)), "on no rank"),           # column 2 of rows 2-3 missing
])
def test_check_sharding_rejects_inconsistent_pieces(second, message):
    per_rank = _two_ranks(*second)
    with pytest.raises(ValueError, match=message):
        check_sharding(per_rank)
    with pytest.raises(ValueError, match=message):
        show_sharding(per_rank, display=False)


def test_check_sharding_rejects_disagreeing_ranks():
    per_rank = _two_ranks((2, 0), (2, 3))
    per_rank[1]["params"][0]["global_shape"] = [5, 3]
    with pytest.raises(ValueError, match="global shape"):
        check_sharding(per_rank)
    with pytest.raises(ValueError, match="ranks 0..1"):
        check_sharding({0: _two_ranks((2, 0), (2, 3))[0]})


def test_sharding_of_a_plain_model_and_names():
    data = sharding_of(toy_model())
    assert (data["rank"], data["world_size"], data["kind"], data["mesh"], data["flat"]) == (0, 1, "local", None, [])
    assert [(p["name"], tuple(p["local_shape"]), p["placements"]) for p in data["params"]] == \
        [(name, shape, []) for name, shape in SHAPES.items()]
    assert clean_name("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.up.weight") == "blocks.0.up.weight"


def test_draw_mesh_1d_and_refuses_3d():
    with warnings.catch_warnings():
        gc.collect()  # not a ResourceWarning for a file an earlier test left to the collector
        warnings.simplefilter("error")
        view = draw_mesh({"shape": [4], "dim_names": ["dp"], "ranks": [0, 1, 2, 3]}, display=False)
        png_bytes(view.figure)
    assert view.coords == {0: (0,), 1: (1,), 2: (2,), 3: (3,)}
    with pytest.raises(ValueError, match="1-D and 2-D"):
        draw_mesh({"shape": [2, 2, 1], "dim_names": ["a", "b", "c"], "ranks": [[[0], [1]], [[2], [3]]]}, display=False)
    assert (view.shape, view.dim_names, view.ranks) == ([4], ["dp"], [0, 1, 2, 3])


@pytest.mark.parametrize("names", [["dim0", "dim1"], ["replicate", "shard"]])
def test_draw_mesh_keeps_its_title_and_labels_inside_the_png(names):
    # mesh_of names an unnamed mesh's dims dim0, dim1: the title was cut at "...one dim0 grou".
    view = draw_mesh({"shape": [2, 2], "dim_names": names, "ranks": [[0, 1], [2, 3]]}, display=False)
    assert view.figure.axes[0].get_title() == (f"DeviceMesh {names[0]}=2 x {names[1]}=2\n"
                                               f"rows: {names[1]} groups, columns: {names[0]} groups")
    assert overflow_inches(view.figure) == 0.0  # nothing reaches past the edges savefig cuts at
