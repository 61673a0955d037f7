"""Which rank holds which slice of each parameter, as plain data (rank side) plus its consistency check.

`sharding_of(model)` runs on every rank after the model was wrapped (DDP,
FSDP1, FSDP2 `fully_shard`, tensor parallel `parallelize_module`, or FSDP2 on
top of TP) and returns a dict of lists, ints and strings: publish it
(`cl.publish("sharding", sharding_of(model))`) and draw it in the notebook with
`draw.sharding.show_sharding(cl.results["sharding"])`. No collective runs: each
rank only describes what it holds, from DTensor placements
(`compute_local_shape_and_global_offset`) or FSDP1's FlatParameter metadata.

torch's own `torch.distributed.tensor.debug.visualize_sharding(dtensor)`
prints one 1-D or 2-D DTensor, on the rank at mesh coordinate 0, as a table of
row/column ranges. Ours goes further:
the whole model at once; FSDP1 FlatParameters (no DTensor there) with each
rank's range, its padding and the original parameters that fall in it; DDP and
plain replicated tensors; data that comes back to the kernel, is drawn there
and checked there (`check_sharding`: the pieces must tile every parameter).

Conventions. `offset` and `local_shape` describe the block
`param[offset[0]:offset[0]+local_shape[0], ...]` of the global parameter; for
FSDP1 (`"flattened": True`) they index the flattened parameter instead. DDP is
recorded as `Replicate()` on a 1-D mesh `("dp",)` over the ranks of its group;
a plain tensor in a TP model has no placements and is a full copy on every rank.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_sharding", "clean_name", "fsdp2_param_groups", "mesh_of", "sharding_of"]

# Wrapper modules insert these into parameter names; the learner thinks in the original names.
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """`_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.up.weight` -> `blocks.0.up.weight`."""
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_PARTS)


def _placement_str(placement: Any) -> str:
    """`Shard(0)`, `_StridedShard(0, sf=2)`, `Replicate()`, `Partial(sum)`: short and unambiguous."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    if isinstance(placement, _StridedShard):
        return f"_StridedShard({placement.dim}, sf={placement.split_factor})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return str(placement)


def mesh_of(mesh: Any) -> dict:
    """A DeviceMesh as plain data to publish: {"shape", "dim_names" (dim0, dim1, ... if unnamed), "ranks"}."""
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    return {"shape": list(mesh.shape), "dim_names": names, "ranks": mesh.mesh.tolist()}


def _param(name: str, tensor: Any, *, global_shape, local_shape, offset, placements=(), mesh_dims=(),
           flattened=False, padding=0) -> dict:
    return {"name": name, "global_shape": [int(s) for s in global_shape],
            "local_shape": [int(s) for s in local_shape], "offset": [int(o) for o in offset],
            "placements": list(placements), "mesh_dims": list(mesh_dims), "flattened": flattened,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "local_bytes": math.prod(local_shape) * tensor.element_size(), "padding": int(padding)}


def _replicated(name: str, p: Any, placements=()) -> dict:
    return _param(name, p, global_shape=p.shape, local_shape=p.shape, offset=[0] * p.dim(),
                  placements=placements, mesh_dims=["dp"] * len(placements))


def fsdp2_param_groups(module: Any) -> list:
    """The FSDP2 parameter groups (`FSDPParamGroup`) of one `fully_shard`-ed module; [] for any other module.

    NOTE: private FSDP2 state, read only: torch 2.13 keeps a list of groups per module
    (`_fsdp_param_groups`), torch 2.11 one group or None (`_fsdp_param_group`).
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if getattr(state, "_fsdp_param_group", None) else []
    return list(groups)


def _fsdp2_padding(model: Any) -> tuple[dict[int, int], int]:
    """id(sharded parameter) -> elements FSDP2 pads its shard with; and the FSDP mesh's ndim."""
    padding, fsdp_ndim = {}, 0
    for module in model.modules():
        for group in fsdp2_param_groups(module):
            fsdp_ndim = max(fsdp_ndim, group.mesh_info.mesh.ndim)
            for fp in group.fsdp_params:
                padding[id(fp.sharded_param)] = fp.padded_sharded_param_size.numel() - fp.sharded_size.numel()
    return padding, fsdp_ndim


def _fsdp1(model: Any, FSDP: Any) -> tuple[list, list, dict | None]:
    """Params (flattened pieces) and one entry per FlatParameter this rank holds."""
    import torch.distributed as dist

    params, flats, mesh = [], [], None
    for module_name, module in model.named_modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
        if handle is None:
            continue
        flat = handle.flat_param
        prefix = clean_name(module_name)
        names = [f"{prefix}.{fqn}" if prefix else fqn for fqn in flat._fqns]
        shard_numel = flat.numel()  # includes this rank's end padding: the same on every rank
        total = flat._unpadded_unsharded_size.numel()  # real elements + alignment padding
        index = handle.rank if handle.uses_sharded_strategy else 0
        start, end = min(index * shard_numel, total), min((index + 1) * shard_numel, total)
        # The unsharded layout, as torch builds it: (name or None for alignment padding, start, end).
        layout, at, real = [], 0, iter(names)
        for numel, is_pad in zip(flat._numels_with_padding, flat._is_padding_mask):
            layout.append((None if is_pad else next(real), at, at + numel))
            at += numel
        align = sum(max(0, min(end, e) - max(start, s)) for n, s, e in layout if n is None)
        pieces = []
        for name, shape, info in zip(names, flat._shapes, flat._shard_param_infos):
            first, last = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            if info.in_shard:
                pieces.append((name, first, last))
            params.append(_param(name, flat, global_shape=shape, local_shape=[last - first], offset=[first],
                                 flattened=True))
        flats.append({"name": clean_name(f"{module_name}._flat_param" if module_name else "_flat_param"),
                      "shard_index": index, "shard_numel": shard_numel, "unsharded_numel": total,
                      "padded_numel": shard_numel * (handle.world_size if handle.uses_sharded_strategy else 1),
                      "shard_start": start, "shard_end": end, "numel": sum(last - first for _, first, last in pieces),
                      "padding": int(flat._shard_numel_padded), "align_padding": align,
                      "pieces": pieces, "layout": layout})
        if mesh is None:
            ranks = dist.get_process_group_ranks(module.process_group)
            mesh = {"shape": [len(ranks)], "dim_names": ["dp"], "ranks": ranks}
    return params, flats, mesh


def sharding_of(model: Any) -> dict:
    """What this rank holds of every parameter of `model` (plain data; see the module docstring).

    Keys: rank, world_size, kind ("ddp", "fsdp1", "fsdp2", "hsdp", "tp", "2d", "local"),
    mesh (None or {"shape", "dim_names", "ranks"}), params (one dict per original
    parameter: name, global_shape, local_shape, offset, placements, mesh_dims,
    flattened, dtype, local_bytes, padding), flat (FSDP1 only: one dict per
    FlatParameter: shard_start/shard_end in the unsharded flat parameter, numel of
    real elements, padding appended, align_padding inside the range, pieces
    [(param, first, last_exclusive)], layout [(param or None, start, end)]).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.nn.parallel import DistributedDataParallel as DDP

    on = dist.is_available() and dist.is_initialized()
    out = {"rank": dist.get_rank() if on else 0, "world_size": dist.get_world_size() if on else 1,
           "kind": "local", "mesh": None, "params": [], "flat": []}
    if isinstance(model, DDP):
        ranks = dist.get_process_group_ranks(model.process_group)
        out.update(kind="ddp", mesh={"shape": [len(ranks)], "dim_names": ["dp"], "ranks": ranks})
        out["params"] = [_replicated(clean_name(n), p, ["Replicate()"])
                         for n, p in model.module.named_parameters()]
        return out
    if any(isinstance(m, FSDP) for m in model.modules()):
        out["params"], out["flat"], out["mesh"] = _fsdp1(model, FSDP)
        out["kind"] = "fsdp1"
        return out

    padding, fsdp_ndim = _fsdp2_padding(model)
    widest = None  # the mesh with the most dims: the model's mesh (head may live on a sub-mesh)
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            out["params"].append(_replicated(clean_name(name), p))
            continue
        mesh = p.device_mesh
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
        if tuple(local_shape) != tuple(p.to_local().shape):  # would mean torch changed the rule
            raise RuntimeError(f"{name}: computed local shape {local_shape} != {tuple(p.to_local().shape)}")
        out["params"].append(_param(
            clean_name(name), p.to_local(), global_shape=p.shape, local_shape=local_shape, offset=offset,
            placements=[_placement_str(pl) for pl in p.placements],
            mesh_dims=mesh_of(mesh)["dim_names"], padding=padding.get(id(p), 0)))
        if widest is None or mesh.ndim > widest.ndim:
            widest = mesh
    if widest is not None:
        out["mesh"] = mesh_of(widest)
        if fsdp_ndim == 0:
            out["kind"] = "tp"
        elif widest.ndim > fsdp_ndim:
            out["kind"] = "2d"
        else:
            out["kind"] = "hsdp" if fsdp_ndim == 2 else "fsdp2"
    elif any(isinstance(m, FSDPModule) for m in model.modules()):
        out["kind"] = "fsdp2"
    return out


# ---------------------------------------------------------------- kernel side: consistency


def _overlap(a: tuple, b: tuple) -> bool:
    """Blocks a, b = (offset, shape) intersect in every dim."""
    return all(max(oa, ob) < min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def _tile(what: str, blocks: dict[int, tuple], extent: list[int]) -> dict[tuple, list[int]]:
    """Group the ranks' blocks by identical (offset, shape); the distinct ones must tile `extent` once."""
    owners: dict[tuple, list[int]] = {}
    for rank, (offset, shape) in sorted(blocks.items()):
        if len(offset) != len(extent) or len(shape) != len(extent):
            raise ValueError(f"{what}: rank {rank} block {offset}+{shape} does not have {len(extent)} dims")
        if any(o < 0 or s < 0 or o + s > e for o, s, e in zip(offset, shape, extent)):
            raise ValueError(f"{what}: rank {rank} block at {list(offset)} of shape {list(shape)} "
                             f"lies outside {list(extent)}")
        if math.prod(shape):
            owners.setdefault((tuple(offset), tuple(shape)), []).append(rank)
    distinct = list(owners.items())
    for i, (a, ra) in enumerate(distinct):
        for b, rb in distinct[i + 1:]:
            if _overlap(a, b):
                raise ValueError(f"{what}: ranks {ra} and {rb} both hold elements of "
                                 f"{list(a[0])}+{list(a[1])} and {list(b[0])}+{list(b[1])}")
    held = sum(math.prod(shape) for _, shape in owners)
    if held != math.prod(extent):  # disjoint and in bounds, so fewer means a gap
        raise ValueError(f"{what}: the ranks hold {held} of {math.prod(extent)} elements: some are on no rank")
    return owners


def check_sharding(per_rank: dict[int, dict]) -> dict[str, dict[tuple, list[int]]]:
    """Raise ValueError unless the ranks' pieces tile every parameter (and FlatParameter) exactly.

    Identical pieces on several ranks are replicas; distinct pieces must not
    overlap and must cover every element. Returns, per parameter,
    {(offset, local_shape): [ranks holding it]}.
    """
    if not per_rank:
        raise ValueError("no ranks' data")
    first = per_rank[min(per_rank)]
    world = first["world_size"]
    if sorted(per_rank) != list(range(world)):
        raise ValueError(f"expected data from ranks 0..{world - 1}, got ranks {sorted(per_rank)}")
    for rank, data in per_rank.items():
        if data["rank"] != rank or data["world_size"] != world or data["kind"] != first["kind"]:
            raise ValueError(f"rank {rank} reports rank {data['rank']}, world size {data['world_size']}, "
                             f"kind {data['kind']!r}; rank {first['rank']} reports {world}, {first['kind']!r}")
        if data["mesh"] != first["mesh"]:
            raise ValueError(f"rank {rank} sees mesh {data['mesh']}, rank {first['rank']} sees {first['mesh']}")
    names = [p["name"] for p in first["params"]]
    by_rank = {}
    for rank, data in per_rank.items():
        by_rank[rank] = {p["name"]: p for p in data["params"]}
        if [p["name"] for p in data["params"]] != names:  # same model, same order: the table relies on it
            raise ValueError(f"rank {rank} lists parameters {[p['name'] for p in data['params']]}, not {names}")
        if [f["name"] for f in data["flat"]] != [f["name"] for f in first["flat"]]:
            raise ValueError(f"rank {rank} lists other FlatParameters than rank {first['rank']}")
    owners = {}
    for name in names:
        shapes = {tuple(by_rank[r][name]["global_shape"]) for r in per_rank}
        if len(shapes) != 1:
            raise ValueError(f"{name}: the ranks disagree on its global shape: {sorted(shapes)}")
        shape = list(shapes.pop())
        extent = [math.prod(shape)] if by_rank[min(per_rank)][name]["flattened"] else shape
        owners[name] = _tile(name, {r: (by_rank[r][name]["offset"], by_rank[r][name]["local_shape"])
                                    for r in per_rank}, extent)
    for i, flat in enumerate(first["flat"]):
        slots = {}
        for rank, data in per_rank.items():
            f = data["flat"][i]
            slots[rank] = ([f["shard_index"] * f["shard_numel"]], [f["shard_numel"]])
            for piece, first_el, last in f["pieces"]:
                p = by_rank[rank].get(piece)
                if p is None or (p["offset"], p["local_shape"]) != ([first_el], [last - first_el]):
                    raise ValueError(f"{f['name']}: rank {rank}'s piece {piece}[{first_el}:{last}] does not "
                                     f"match its parameter entry")
        owners[flat["name"]] = _tile(flat["name"], slots, [flat["padded_numel"]])
    return owners
