"""Draw one collective as every rank's tensor before and after it, coloured by where values came from.

A lesson cell publishes the tensor around the call, the kernel draws it:

    cl.publish("before", t.clone()); dist.all_reduce(t); cl.publish("after", t)   # on every rank
    cl.show_collective("all_reduce", cl.results["before"], cl.results["after"])   # in the kernel

Each rank is one row of cells with the values written in them. Before the call a
cell has its own rank's colour; after it, the colour of the rank(s) the value
came from: one colour for a copy (broadcast, all_gather, gather, scatter,
all_to_all), stripes of every rank's colour for a reduction (all_reduce, reduce,
reduce_scatter). Provenance is inferred from the op and the shapes, then checked
against the values: a copied cell whose value differs from its source is left
grey, so a wrong result shows. Other ops are drawn without provenance.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..units import readable_number
from ..vocabulary import DATA_FLOWS, data_flow
from .figures import new_figure, rank_color, show

__all__ = ["CollectiveView", "draw_cell", "format_values", "show_collective"]

_UNKNOWN_COLOR = "#e0e0e0"

Source = tuple[int, int]  # (rank, index in that rank's flattened "before")


@dataclasses.dataclass
class CollectiveView:
    """What `show_collective` drew: values per rank, where each "after" value came from, the figure.

    `provenance[rank][i]` lists the (source rank, source index) pairs that made
    after-value i (one pair for a copy, one per rank for a reduction), or is None
    when not inferred. `source_ranks[rank][i]` is the ranks whose colours the cell
    has (empty: grey). `root` is the src/dst rank of a rooted op; `reduce_op`
    the ReduceOp ("sum", "avg", "max", "min", "product") every reduced value fits.
    """

    op: str
    ranks: list[int]
    before: dict[int, list]
    after: dict[int, list]
    provenance: dict[int, list[list[Source] | None]]
    source_ranks: dict[int, list[tuple[int, ...]]]
    root: int | None
    reduce_op: str | None
    lines: list[str]
    figure: Any = dataclasses.field(repr=False)

    def __repr__(self) -> str:  # short: the lines were already printed
        return f"CollectiveView(op={self.op!r}, ranks={self.ranks}, root={self.root}, reduce_op={self.reduce_op!r})"


def _flatten(value: Any) -> list:
    """A tensor, array, number, None or (nested) list of them, as one flat list of Python numbers."""
    if value is None:
        return []
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    if hasattr(value, "tolist"):  # torch and numpy; a 0-d tensor gives a number
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flatten(item)]
    return [value]


def _fmt(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))  # 3.0 -> "3": all_reduce of torch.ones reads as in the lesson text
    if isinstance(v, float):
        return readable_number(v, 4)  # 12345.6 -> "12,350", not "1.235e+04"
    return str(v)


def format_values(values: list, *, max_items: int = 16) -> str:
    """`[1, 2, 3]`, integral floats without ".0", cut after `max_items` with the count left."""
    shown = ", ".join(_fmt(v) for v in values[:max_items])
    more = f", ... +{len(values) - max_items}" if len(values) > max_items else ""
    return f"[{shown}{more}]"


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) or (a != a and b != b)
    return a == b


def _infer_root(op: str, ranks: list[int], before: dict, after: dict, n: int) -> int | None:
    """The src/dst of a rooted op, read from the data; None when the data do not say."""
    size = len(ranks)
    if size == 1:
        return ranks[0]
    if op == "broadcast":
        return next((r for r in ranks if before[r] and before[r] == after[ranks[0]]), None)
    if op == "scatter":
        return next((r for r in ranks if len(before[r]) == size * n and n), None)
    if op == "gather":
        return next((r for r in ranks if n and len(after[r]) == size * n), None)
    # reduce: the destination's values change; gloo also leaves partial sums on some other
    # ranks (measured: dst=2 of 3 left rank 0 with the full sum), so this can be ambiguous.
    changed = [r for r in ranks if after[r] != before[r]]
    if len(changed) != 1:
        raise ValueError(f"show_collective: cannot tell reduce's destination from the data "
                         f"(ranks {changed} changed); pass root=<dst>")
    return changed[0]


def _provenance(op: str, ranks: list[int], before: dict, after: dict, root: int | None):
    """Sources of every after-cell for the eight known ops (None where shapes do not fit), and the root."""
    size = len(ranks)
    own = {r: [[(r, i)] for i in range(len(after[r]))] if after[r] == before[r] else None for r in ranks}
    unknown = {r: [None] * len(after[r]) for r in ranks}
    lens_b = {len(before[r]) for r in ranks}
    if op not in DATA_FLOWS:
        return unknown, root
    n_before = next(iter(lens_b)) if len(lens_b) == 1 else None
    n_after = len(after[ranks[0]])
    if op in ("broadcast", "reduce", "scatter", "gather") and root is None:
        n = n_after if op == "scatter" else (n_before or 0)
        root = _infer_root(op, ranks, before, after, n)
    if op in ("broadcast", "reduce", "scatter", "gather") and root not in ranks:
        return unknown, root
    prov: dict[int, list] = {}
    for k, r in enumerate(ranks):
        m = len(after[r])
        if op == "all_reduce" and n_before == m:
            prov[r] = [[(s, i) for s in ranks] for i in range(m)]
        elif op == "broadcast" and m == len(before[root]):
            prov[r] = [[(root, i)] for i in range(m)]
        elif op == "reduce" and r == root and n_before == m:
            prov[r] = [[(s, i) for s in ranks] for i in range(m)]
        elif op == "all_gather" and n_before is not None and m == size * n_before:
            prov[r] = [[(ranks[j // n_before], j % n_before)] for j in range(m)]
        elif op == "gather" and r == root and n_before is not None and m == size * n_before:
            prov[r] = [[(ranks[j // n_before], j % n_before)] for j in range(m)]
        elif op == "scatter" and len(before[root]) == size * m:
            prov[r] = [[(root, k * m + i)] for i in range(m)]
        elif op == "reduce_scatter" and n_before == size * m:
            prov[r] = [[(s, k * m + i) for s in ranks] for i in range(m)]
        elif op == "all_to_all" and n_before == m and m % size == 0:
            c = m // size  # chunk j of rank k's output is chunk k of rank j's input
            prov[r] = [[(ranks[j // c], k * c + j % c)] for j in range(m)]
        elif op in ("reduce", "gather") and r != root:
            prov[r] = own[r] or unknown[r]  # not the destination: untouched, or undefined
        else:
            prov[r] = unknown[r]
    return prov, root


# The reductions torch.distributed offers (ReduceOp), in the order a tie is named.
_REDUCTIONS = {"sum": sum, "avg": lambda xs: sum(xs) / len(xs), "max": max, "min": min, "product": math.prod}


def _check(prov: dict, before: dict, after: dict) -> str | None:
    """Keep a cell's sources only where its value is what they make; return the ReduceOp all reduced cells fit.

    A copy must equal its source; a reduced cell must equal some reduction of
    its sources. Where not, the cell is left grey rather than drawn as a lie.
    """
    fits, reduced = dict.fromkeys(_REDUCTIONS, True), False
    for r, cells in prov.items():
        for i, src in enumerate(cells):
            if not src:
                continue
            if any(j >= len(before[s]) for s, j in src):
                cells[i] = None
                continue
            inputs = [before[s][j] for s, j in src]
            if len(src) == 1:
                if not _close(after[r][i], inputs[0]):
                    cells[i] = None
                continue
            if not all(isinstance(x, (int, float)) for x in [*inputs, after[r][i]]):
                continue
            ok = {name for name, f in _REDUCTIONS.items() if _close(after[r][i], f(inputs))}
            if not ok:
                cells[i] = None
            reduced = True
            for name in fits:
                fits[name] = fits[name] and name in ok
    return next((name for name, fit in fits.items() if fit), None) if reduced else None


def draw_cell(ax: Any, x: float, y: float, text: str, colors: tuple[str, ...] | list[str], *,
              width: float = 1.0, height: float = 0.8, alpha: float = 0.55) -> None:
    """One cell at (x, y) (lower left): vertical stripes, one per colour (grey if none), `text` centred."""
    from matplotlib.patches import Rectangle

    colors = list(colors) or [_UNKNOWN_COLOR]
    stripe = width / len(colors)
    for i, color in enumerate(colors):
        ax.add_patch(Rectangle((x + i * stripe, y), stripe, height, facecolor=color, alpha=alpha, lw=0))
    ax.add_patch(Rectangle((x, y), width, height, fill=False, edgecolor="#333333", lw=0.8))
    size = 8 if len(text) <= 3 else 6.5 if len(text) <= 5 else 5.5
    # On stripes the number needs a backing to stay readable.
    box = dict(boxstyle="round,pad=0.15", facecolor="white", alpha=0.8, lw=0) if len(colors) > 1 else None
    ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", fontsize=size, bbox=box)


def _draw(ranks: list[int], before: dict, after: dict, source_ranks: dict, title: str,
          max_cells: int) -> Any:
    nb = min(max(max(len(before[r]) for r in ranks), 1), max_cells)
    na = min(max(max(len(after[r]) for r in ranks), 1), max_cells)
    gap = 1.6  # room for the arrow between the two blocks, and for "+k"
    xa = nb + gap + 0.4
    fig = new_figure(max(4.6, 0.42 * (nb + na + gap + 3) + 0.6), 0.45 * len(ranks) + 1.3)
    ax = fig.add_subplot()
    for row, r in enumerate(ranks):
        y = -row
        ax.text(-0.3, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9, color=rank_color(r))
        for i, v in enumerate(before[r][:max_cells]):
            draw_cell(ax, i, y, _fmt(v), [rank_color(r)])
        if len(before[r]) > max_cells:
            ax.text(nb + 0.1, y + 0.4, f"+{len(before[r]) - max_cells}", va="center", fontsize=7)
        ax.annotate("", xy=(xa - 0.25, y + 0.4), xytext=(nb + 0.75, y + 0.4),
                    arrowprops=dict(arrowstyle="->", color="#555555"))
        for i, v in enumerate(after[r][:max_cells]):
            draw_cell(ax, xa + i, y, _fmt(v), [rank_color(s) for s in source_ranks[r][i]])
        if len(after[r]) > max_cells:
            ax.text(xa + na + 0.1, y + 0.4, f"+{len(after[r]) - max_cells}", va="center", fontsize=7)
    ax.text(nb / 2, 1.05, "before", ha="center", fontsize=9)
    ax.text(xa + na / 2, 1.05, "after", ha="center", fontsize=9)
    ax.set_xlim(-2.2, xa + na + 0.8)
    ax.set_ylim(-len(ranks) + 0.7, 1.5)
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    fig.supxlabel("colour: source rank;  stripes: several ranks combined;  grey: not inferred",
                  fontsize=7, color="#555555")
    return fig


def show_collective(op: str, before: dict[int, Any], after: dict[int, Any], *, title: str | None = None,
                    root: int | None = None, max_cells: int = 16, quiet: bool = False) -> CollectiveView:
    """Print `rank r: [before] -> [after]` per rank and draw the collective `op`; return a `CollectiveView`.

    `before`/`after`: {rank: tensor, list of numbers, list of tensors or None},
    as `cl.results[name]` holds them; tensors are flattened (so a list of
    tensors, as `dist.all_gather` fills, reads as its concatenation). `root`:
    the src/dst of broadcast, reduce, scatter, gather; inferred from the data
    when None. `quiet=True` neither prints nor displays (tests).
    """
    if not before or set(before) != set(after):
        raise ValueError(f"show_collective: before has ranks {sorted(before)}, after has ranks {sorted(after)}; "
                         "they must be the same, non-empty")
    name = op.lower().replace("-", "_").replace("dist.", "")
    name = data_flow(name) or name  # any spelling of a call (all_gather_into_tensor) -> its data flow (all_gather)
    ranks = sorted(before)
    flat_before = {r: _flatten(before[r]) for r in ranks}
    flat_after = {r: _flatten(after[r]) for r in ranks}
    provenance, root = _provenance(name, ranks, flat_before, flat_after, root)
    reduce_op = _check(provenance, flat_before, flat_after)
    source_ranks = {r: [tuple(sorted({s for s, _ in src})) if src else () for src in provenance[r]] for r in ranks}
    lines = [f"rank {r}: {format_values(flat_before[r], max_items=max_cells)} -> "
             f"{format_values(flat_after[r], max_items=max_cells)}" for r in ranks]
    if title is None:
        title = f"{op} on {len(ranks)} ranks" + (f" (root {root})" if root is not None else "")
    fig = _draw(ranks, flat_before, flat_after, source_ranks, title, max_cells)
    if not quiet:
        print("\n".join(lines))
        show(fig)
    return CollectiveView(name, ranks, flat_before, flat_after, provenance, source_ranks, root, reduce_op,
                          lines, fig)
