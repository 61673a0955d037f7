"""Kernel side of `sharding`: draw which rank holds which slice of each parameter, and the DeviceMesh.

Input is what the ranks published with `sharding.sharding_of(model)`,
`{rank: data}` (e.g. `cl.results["sharding"]`). `show_sharding` first checks
that the pieces tile every parameter exactly once (replicas aside), then draws
one panel per parameter in its global shape (rows = dim 0; a 1-D tensor is a
column), cut into blocks coloured by the rank that holds them; FSDP2's padding
rows hang below in hatched grey; FSDP1's FlatParameters get one bar each (the
padded flat tensor split into equal rank slots, parameter boundaries marked,
alignment and end padding hatched). `draw_mesh` draws the DeviceMesh as a grid
of rank boxes. Both return their data next to the figure, so a test or grader
asserts on exactly what the learner sees.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .figures import fit_figure, new_figure, rank_color, show
from ..measure.sharding import check_sharding

__all__ = ["MeshView", "ShardingView", "draw_mesh", "show_sharding"]

_PAD = dict(facecolor="#dddddd", hatch="///", edgecolor="#888888", linewidth=0.5)


@dataclasses.dataclass
class ShardingView:
    """What `show_sharding` drew. `owners[param]`: (rank, offset, local_shape) for every rank, in rank order
    (FSDP1: offsets into the flattened parameter); `blocks[param]`: {(offset, shape): ranks holding it};
    `flat[flat_param]`: FSDP1's per-rank entries; `padding[rank]`: elements it stores that belong to no parameter."""

    kind: str
    world_size: int
    mesh: dict | None
    shapes: dict[str, tuple[int, ...]]
    placements: dict[str, list[str]]
    owners: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]
    blocks: dict[str, dict[tuple, list[int]]]
    flat: dict[str, list[dict]]
    padding: dict[int, int]
    table: str
    figure: Any = dataclasses.field(repr=False)


@dataclasses.dataclass
class MeshView:
    """What `draw_mesh` drew: the mesh, and each rank's coordinate in it."""

    shape: list[int]
    dim_names: list[str]
    ranks: list
    coords: dict[int, tuple[int, ...]]
    figure: Any = dataclasses.field(repr=False)


# ---------------------------------------------------------------- text


def _slice_text(offset, shape, global_shape, flattened: bool, padding: int) -> str:
    if not math.prod(shape):
        text = "-"
    elif list(shape) == ([math.prod(global_shape)] if flattened else list(global_shape)):
        text = "full"
    else:
        dims = [":" if (o, s) == (0, g) and not flattened else f"{o}:{o + s}"
                for o, s, g in zip(offset, shape, [math.prod(global_shape)] if flattened else global_shape)]
        text = ("flat[" if flattened else "[") + ", ".join(dims) + "]"
    return text + (f" +{padding} pad" if padding else "")


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _placement_text(p: dict) -> str:
    if p["flattened"]:
        return "FlatParameter"
    if not p["placements"]:
        return "full copy"
    if len(p["placements"]) == 1:
        return p["placements"][0]
    return ", ".join(f"{d}={pl}" for d, pl in zip(p["mesh_dims"], p["placements"]))


def _table(kind: str, world: int, mesh: dict | None, per_rank: dict, padding: dict) -> str:
    ranks = sorted(per_rank)
    head = f"{kind} on {world} ranks"
    if mesh:
        head += ", mesh " + " x ".join(f"{n}={s}" for n, s in zip(mesh["dim_names"], mesh["shape"]))
        head += f": {mesh['ranks']}"
    rows = [["parameter", "shape", "placements"] + [f"rank {r}" for r in ranks]]
    for i, p in enumerate(per_rank[ranks[0]]["params"]):
        cells = [_slice_text(per_rank[r]["params"][i]["offset"], per_rank[r]["params"][i]["local_shape"],
                             p["global_shape"], p["flattened"], per_rank[r]["params"][i]["padding"]) for r in ranks]
        rows.append([p["name"], "x".join(map(str, p["global_shape"])) or "scalar", _placement_text(p)] + cells)
    rows.append(["padding (elements)", "", ""] + [str(padding[r]) for r in ranks])
    text = head + "\n" + _columns(rows)
    flats = per_rank[ranks[0]]["flat"]
    if flats:
        rows = [["flat parameter", "rank", "range", "real", "pad", "align", "pieces"]]
        for i, f in enumerate(flats):
            for r in ranks:
                g = per_rank[r]["flat"][i]
                pieces = " ".join(f"{n}[{a}:{b}]" for n, a, b in g["pieces"]) or "-"
                rows.append([f["name"], str(r), f"[{g['shard_start']}:{g['shard_end']}]", str(g["numel"]),
                             str(g["padding"]), str(g["align_padding"]), pieces])
        text += "\n\n" + _columns(rows)
    return text


# ---------------------------------------------------------------- figure


def _grid_shape(shape) -> tuple[int, int]:
    """Rows and columns a parameter is drawn with: dim 0 down, the rest across (a 1-D tensor is a column)."""
    shape = list(shape) or [1]
    return shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1


def _flat_rects(a: int, b: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Elements [a, b) of a row-major grid: a partial first row, whole rows, a partial last row."""
    out = []
    while a < b:
        row, col = divmod(a, cols)
        if col == 0 and b - a >= cols:
            out.append((0, row, cols, (b - a) // cols))
            a += (b - a) // cols * cols
        else:
            out.append((col, row, min(cols - col, b - a), 1))
            a += min(cols - col, b - a)
    return out


def _rects(offset, shape, global_shape, flattened: bool) -> list[tuple[int, int, int, int]]:
    """(col, row, width, height) rectangles covering a block (or a flattened range) on the drawn grid."""
    rows, cols = _grid_shape(global_shape)
    if flattened:
        return _flat_rects(offset[0], offset[0] + shape[0], cols)
    if len(global_shape) <= 1:
        return [(0, offset[0] if offset else 0, 1, shape[0] if shape else 1)]
    if len(global_shape) > 2:  # dims after 0 drawn as one: exact when they are whole (FSDP2's Shard(0))
        return [(0, offset[0], cols, shape[0])]
    return [(offset[1], offset[0], shape[1], shape[0])]


def _short(p: dict) -> str:
    """Placements as torch prints them (`S(0)`, `R`, `_S(0, 2)`), to fit a panel's title."""
    if p["flattened"] or not p["placements"]:
        return _placement_text(p)
    short = [pl.replace("Shard(", "S(").replace("Replicate()", "R").replace("_StridedS(", "_S(")
             .replace(" sf=", " ") for pl in p["placements"]]
    return short[0] if len(short) == 1 else " ".join(f"{d}:{pl}" for d, pl in zip(p["mesh_dims"], short))


def _draw_param(ax, name: str, p0: dict, blocks: dict, pads: dict[int, int], world: int) -> None:
    from matplotlib.patches import Rectangle

    rows, cols = _grid_shape(p0["global_shape"])
    pad_rows = 0.0
    for (offset, shape), ranks in blocks.items():
        for col, row, width, height in _rects(offset, shape, p0["global_shape"], p0["flattened"]):
            ax.add_patch(Rectangle((col, row), width, height, facecolor=rank_color(ranks[0]), edgecolor="white",
                                   linewidth=0.8, hatch="//" if len(ranks) > 1 else None))
        col, row, width, height = _rects(offset, shape, p0["global_shape"], p0["flattened"])[0]
        label = "all" if len(ranks) > 1 and len(ranks) == world else ",".join(map(str, ranks))
        ax.text(col + width / 2, row + height / 2, label, ha="center", va="center",
                fontsize=7, color="white", fontweight="bold")
    for rank, numel in sorted(pads.items()):  # FSDP2: each rank's shard is padded to ceil(dim0 / N) rows
        height = numel / cols
        ax.add_patch(Rectangle((0, rows + pad_rows), cols, height, **{**_PAD, "edgecolor": rank_color(rank)}))
        pad_rows += height
    ax.set_xlim(0, cols)
    ax.set_ylim(rows + pad_rows, 0)  # row 0 at the top, like a printed matrix
    ax.set_aspect("equal", adjustable="box")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"{name}\n{'x'.join(map(str, p0['global_shape']))} {_short(p0)}", fontsize=7)


def _draw_flat(ax, per_rank: dict, index: int) -> None:
    from matplotlib.patches import Rectangle

    f0 = per_rank[min(per_rank)]["flat"][index]
    for rank in sorted(per_rank):
        f = per_rank[rank]["flat"][index]
        slot = f["shard_index"] * f["shard_numel"]
        ax.add_patch(Rectangle((slot, 0), f["shard_numel"], 1, facecolor=rank_color(rank), edgecolor="white"))
        if f["padding"]:
            ax.add_patch(Rectangle((slot + f["shard_numel"] - f["padding"], 0), f["padding"], 1, **_PAD))
        ax.text(slot + f["shard_numel"] / 2, 0.5, f"rank {rank}", ha="center", va="center", fontsize=7,
                color="white", fontweight="bold")
    prefix = f0["name"].removesuffix("_flat_param")
    for name, start, end in f0["layout"]:
        if name is None:  # alignment padding (use_orig_params=True)
            ax.add_patch(Rectangle((start, 0), end - start, 1, **_PAD))
            continue
        ax.axvline(start, color="black", linewidth=0.8)
        ax.text(start + (end - start) / 2, 1.05, name.removeprefix(prefix), ha="center", va="bottom", fontsize=6)
    ax.set_xlim(0, f0["padded_numel"])
    ax.set_ylim(0, 1.6)
    ax.set_yticks([])
    real = sum(end - start for name, start, end in f0["layout"] if name is not None)
    ax.tick_params(labelsize=7)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)  # element indices, never "1e6"
    ax.set_title(f"{f0['name']}: {real} parameter elements + {f0['padded_numel'] - real} padding", fontsize=8)


def show_sharding(per_rank: dict[int, dict], *, title: str | None = None, display: bool = True) -> ShardingView:
    """Check, tabulate and draw `{rank: sharding_of(model)}`; raise ValueError if the pieces don't tile."""
    from matplotlib.patches import Patch

    blocks = check_sharding(per_rank)
    ranks = sorted(per_rank)
    first = per_rank[ranks[0]]
    kind, world = first["kind"], first["world_size"]
    padding = {r: sum(f["padding"] + f["align_padding"] for f in per_rank[r]["flat"])
               + sum(p["padding"] for p in per_rank[r]["params"]) for r in ranks}
    params = first["params"]
    owners = {p["name"]: [(r, tuple(per_rank[r]["params"][i]["offset"]), tuple(per_rank[r]["params"][i]["local_shape"]))
                          for r in ranks] for i, p in enumerate(params)}
    table = _table(kind, world, first["mesh"], per_rank, padding)

    ncols = min(5, max(1, len(params)))
    nrows = -(-len(params) // ncols)
    flats = first["flat"]
    fig = new_figure(2.0 * ncols + 0.5, 2.3 * nrows + 1.1 * len(flats) + 0.6)
    grid = fig.add_gridspec(nrows + len(flats), ncols, height_ratios=[2.3] * nrows + [1.0] * len(flats))
    for i, p in enumerate(params):
        ax = fig.add_subplot(grid[i // ncols, i % ncols])
        # Padding per distinct block: replicas pad the same, drawing theirs twice would double it.
        first_holder = {}
        for r, offset, shape in owners[p["name"]]:
            first_holder.setdefault((offset, shape), r)
        pads = {r: per_rank[r]["params"][i]["padding"] for r in first_holder.values()
                if per_rank[r]["params"][i]["padding"]}
        _draw_param(ax, p["name"], p, blocks[p["name"]], pads, world)
    for j in range(len(flats)):
        _draw_flat(fig.add_subplot(grid[nrows + j, :]), per_rank, j)
    handles = [Patch(facecolor=rank_color(r), label=f"rank {r}") for r in ranks]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="//", label="held by several ranks"),
                Patch(**_PAD, label="padding")]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=7)
    fig.suptitle(title or table.splitlines()[0], fontsize=9)
    if display:
        print(table)
        show(fig)
    return ShardingView(kind=kind, world_size=world, mesh=first["mesh"],
                        shapes={p["name"]: tuple(p["global_shape"]) for p in params},
                        placements={p["name"]: list(p["placements"]) for p in params}, owners=owners,
                        blocks=blocks, flat={f["name"]: [per_rank[r]["flat"][j] for r in ranks]
                                             for j, f in enumerate(flats)},
                        padding=padding, table=table, figure=fig)


def draw_mesh(mesh: dict, *, title: str | None = None, display: bool = True) -> MeshView:
    """Draw a 1-D or 2-D DeviceMesh (a `sharding_of(...)["mesh"]` dict, or the `{rank: data}` dict)."""
    from matplotlib.patches import Rectangle

    if mesh and all(isinstance(k, int) for k in mesh):  # {rank: sharding data}: every rank must agree
        meshes = [data["mesh"] for _, data in sorted(mesh.items())]
        if any(m != meshes[0] for m in meshes):
            raise ValueError(f"the ranks report different meshes: {meshes}")
        mesh = meshes[0]
    if not mesh:
        raise ValueError("no mesh: this model is not sharded over a DeviceMesh or process group")
    shape, names, ranks = list(mesh["shape"]), list(mesh["dim_names"]), mesh["ranks"]
    if len(shape) not in (1, 2):
        raise ValueError(f"draw_mesh draws 1-D and 2-D meshes, got shape {shape}")
    grid = [ranks] if len(shape) == 1 else ranks  # a 1-D mesh is one row
    coords = {}
    fig = new_figure(1.1 * len(grid[0]) + 1.2, 1.0 * len(grid) + 1.0)
    ax = fig.add_subplot()
    for i, row in enumerate(grid):
        for j, rank in enumerate(row):
            coords[rank] = (j,) if len(shape) == 1 else (i, j)
            ax.add_patch(Rectangle((j + 0.05, i + 0.05), 0.9, 0.9, facecolor=rank_color(rank), edgecolor="black"))
            ax.text(j + 0.5, i + 0.5, f"rank {rank}", ha="center", va="center", color="white", fontweight="bold")
    ax.set_xlim(0, len(grid[0]))
    ax.set_ylim(len(grid), 0)
    ax.set_aspect("equal")
    ax.set_xticks([j + 0.5 for j in range(len(grid[0]))], [f"{names[-1]}={j}" for j in range(len(grid[0]))])
    ax.set_yticks([i + 0.5 for i in range(len(grid))], [f"{names[0]}={i}" for i in range(len(grid))]
                  if len(shape) == 2 else [""])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    label = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
    if len(shape) == 2:
        label += f"\nrows: {names[1]} groups, columns: {names[0]} groups"
    ax.set_title(title or f"DeviceMesh {label}", fontsize=9)
    fit_figure(fig)  # long dim names ("dim0", "replicate") widen the title and tick labels past 2 boxes
    if display:
        show(fig)
    return MeshView(shape=shape, dim_names=names, ranks=ranks, coords=coords, figure=fig)
