"""Draw memory per rank and phase as stacked bars, measured beside predicted, one panel per strategy.

Ranks publish `memory.measure_step(...)`; the kernel draws:

    cl.publish("memory", cl_memory.measure_step(model, opt, batch, loss_fn, strategy="fsdp2"))  # every rank
    view = show_memory(cl.results["memory"], model=toy_model(), unit_type=Block)               # the kernel

Each bar is one rank after one phase (init, forward, backward, step) or at the
peak, stacked by category in the course's colours: parameters, gradients,
optimizer state and communication buffers first (the parts predicted exactly),
then activations and "other" (temporaries). A dashed outline over each part is
the prediction from `memory.predict_step`: where a bar fills its outline, the
run holds exactly the bytes the shapes say. The table printed below gives the
numbers, measured/predicted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..measure.memory import EXACT, PHASES, named_shapes, predict_step, unit_prefixes
from ..units import unit_for
from ..vocabulary import STRATEGIES
from .figures import CATEGORY_COLORS, fit_figure, new_figure, show

__all__ = ["MemoryRow", "MemoryView", "show_memory"]

STACK = (*EXACT, "activations", "other")  # exact parts at the bottom, so outlines line up with them
COLUMNS = (*PHASES, "peak")
# Under DDP (and ZeRO-1, which runs DDP) the "buffers" category holds only DDP's gradient buckets: the
# table and legend say so when no other strategy is shown ("buffers" also names a module's own buffers,
# such as BatchNorm's running statistics, which torch's tracker files under "other").
BUCKET_STRATEGIES = ("ddp", "zero1")
BUCKET_LABEL = "ddp buckets"
VIEW_SUFFIX = "+view"  # a DDP result measured with gradient_as_bucket_view=True


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """Bytes of one category on one rank after one phase; `predicted` is None where nothing is predicted."""

    strategy: str
    rank: int
    phase: str
    category: str
    measured: int
    predicted: int | None


@dataclasses.dataclass
class MemoryView:
    """What `show_memory` drew: one row per (strategy, rank, phase, category), the table, the figure."""

    rows: list[MemoryRow]
    table: str
    theory: dict[str, dict[str, float]]  # per strategy: ZeRO's padding-free bytes per rank
    figure: Any = dataclasses.field(repr=False)

    def get(self, strategy: str, rank: int, phase: str, category: str) -> MemoryRow:
        """The row for one bar segment."""
        for row in self.rows:
            if (row.strategy, row.rank, row.phase, row.category) == (strategy, rank, phase, category):
                return row
        raise KeyError((strategy, rank, phase, category))

    def mismatches(self) -> list[MemoryRow]:
        """Rows whose measured bytes differ from a prediction."""
        return [r for r in self.rows if r.predicted is not None and r.measured != r.predicted]

    def __repr__(self) -> str:  # short: the table was already printed
        return f"MemoryView({len(self.rows)} rows, {len(self.mismatches())} mismatches)"


def _collect(obj: Any) -> list[dict]:
    """Every `measure_step`/`predict_step` result inside `obj` (a result, or dicts/lists of them)."""
    if isinstance(obj, dict) and "phases" in obj and "strategy" in obj:
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [found for value in values for found in _collect(value)]


def _order(results: list[dict]) -> list[dict]:
    known = {s: i for i, s in enumerate(STRATEGIES)}
    return sorted(results, key=lambda r: (known.get(r["strategy"], len(known)), _label(r), r["rank"]))


def _label(result: dict) -> str:
    """The strategy as the table and the panels name it: DDP with gradient_as_bucket_view=True gets "+view"."""
    return result["strategy"] + (VIEW_SUFFIX if result.get("gradient_as_bucket_view") else "")


def _category_names(strategies: list[str]) -> dict[str, str]:
    """Column and legend names: "buffers" reads "ddp buckets" when every result shown is DDP's (or ZeRO-1's)."""
    names = {c: c for c in STACK}
    if strategies and all(s.removesuffix(VIEW_SUFFIX) in BUCKET_STRATEGIES for s in strategies):
        names["buffers"] = BUCKET_LABEL
    return names


def show_memory(results: Any, *, model: Any = None, unit_type: type | None = None, optimizer: str = "adam",
                predicted: Any = None, element_size: int = 4, title: str | None = None,
                display: bool = True) -> MemoryView:
    """Stacked bars of memory per rank, phase and strategy, with predictions outlined; prints a table.

    `results`: what ranks published from `measure_step` (`cl.results[name]`, a
    dict by rank, by strategy, or nested). Predictions come from `predicted`
    (`predict_step` results, nested the same way) or, given the unwrapped
    `model` (and `unit_type`, the class FSDP wraps), are computed here.
    A DDP result measured with `gradient_as_bucket_view=True` is shown as its own
    strategy, "ddp+view"; when only DDP (or ZeRO-1) is shown, the "buffers" column
    is named "ddp buckets", what it holds there. Rows keep the category "buffers".
    """
    measured = _order(_collect(results))
    if not measured:
        raise ValueError("no measure_step results found")
    predictions = {(_label(p), p["rank"]): p for p in _collect(predicted)} if predicted else {}
    if model is not None and not predictions:
        shapes = named_shapes(model)
        units = unit_prefixes(model, unit_type) if unit_type is not None else []
        predictions = {(_label(r), r["rank"]): predict_step(
            shapes, strategy=r["strategy"], world_size=r["world_size"], rank=r["rank"], units=units,
            optimizer=optimizer, element_size=element_size,
            gradient_as_bucket_view=bool(r.get("gradient_as_bucket_view"))) for r in measured}

    rows = []
    for result in measured:
        pred = predictions.get((_label(result), result["rank"]))
        for phase in COLUMNS:
            values = result["peak"] if phase == "peak" else result["phases"][phase]
            for category in STACK:
                expected = pred["phases"][phase].get(category) if pred and phase != "peak" else None
                rows.append(MemoryRow(_label(result), result["rank"], phase, category,
                                      int(values.get(category, 0)), expected))
    theory = {_label(p): p["theory"] for p in predictions.values()}
    names = _category_names(list(dict.fromkeys(r.strategy for r in rows)))
    table = _table(rows, theory, _rounding_note(measured), names)
    figure = _draw(rows, title or "Memory per rank: measured (bars) and predicted (dashed)", names)
    if display:
        print(table)
        show(figure)
    return MemoryView(rows, table, theory, figure)


def _rounding_note(measured: list[dict]) -> str:
    """On CUDA: how much 512-byte block rounding was taken out of "other" (measure_step), per phase; else ""."""
    rounded = [r for r in measured if r.get("cuda_rounding")]
    if not rounded:
        return ""
    worst = {phase: max(r["cuda_rounding"][phase] for r in rounded) for phase in rounded[0]["cuda_rounding"]}
    return ("CUDA: torch's tracker counts each storage rounded up to 512 B, as the allocator allocates; the exact "
            "columns are not rounded, and 'other' excludes that rounding (up to "
            + ", ".join(f"{phase} {n} B" for phase, n in worst.items()) + " per rank).")


def _exact(nbytes: float) -> str:
    """Bytes as the table's other cells print them (all digits, so they compare); a fraction to 0.1 B."""
    return str(int(nbytes)) if float(nbytes).is_integer() else f"{nbytes:.1f}"


def _table(rows: list[MemoryRow], theory: dict, note: str = "", names: dict[str, str] | None = None) -> str:
    """One line per (strategy, rank, phase): measured/predicted per category, '!' where they differ."""
    names = names or {c: c for c in STACK}
    width = max([8, *(len(r.strategy) for r in rows)])
    header = (f"{'strategy':<{width}} {'rank':>4} {'phase':<8}" + "".join(f" {names[c]:>13}" for c in STACK)
              + f" {'total':>8}")
    lines = [header, "-" * len(header)]
    cells: dict[tuple, list[MemoryRow]] = {}
    for row in rows:
        cells.setdefault((row.strategy, row.rank, row.phase), []).append(row)
    for (strategy, rank, phase), group in cells.items():
        text = []
        for row in group:
            cell = str(row.measured)
            if row.predicted is not None:
                cell += ("/" if row.measured == row.predicted else "!") + str(row.predicted)
            text.append(f" {cell:>13}")
        lines.append(f"{strategy:<{width}} {rank:>4} {phase:<8}" + "".join(text)
                     + f" {sum(r.measured for r in group):>8}")
    lines.append("bytes measured/predicted ('!': differs); activations, other and peak are measured only.")
    if any(r.strategy.endswith(VIEW_SUFFIX) for r in rows):
        lines.append(f"{VIEW_SUFFIX}: DDP with gradient_as_bucket_view=True (each .grad is a view into its bucket).")
    if note:
        lines.append(note)
    same: dict[str, list[str]] = {}  # one line for the strategies with the same formula (ddp and ddp+view)
    for strategy, zero in theory.items():
        same.setdefault(", ".join(f"{k} {_exact(v)}" for k, v in zero.items()), []).append(strategy)
    for values, strategies in same.items():
        lines.append(f"ZeRO formula, {' and '.join(strategies)} (no padding, no buffers): {values} bytes per rank")
    return "\n".join(lines)


def _draw(rows: list[MemoryRow], title: str, names: dict[str, str] | None = None) -> Any:
    from matplotlib.patches import Patch, Rectangle

    strategies = list(dict.fromkeys(r.strategy for r in rows))
    ranks = {s: sorted({r.rank for r in rows if r.strategy == s}) for s in strategies}
    fig = new_figure(max(6.4, 3.4 * len(strategies)), 4.2)
    axes = fig.subplots(1, len(strategies), sharey=True, squeeze=False)[0]
    by_key = {(r.strategy, r.rank, r.phase, r.category): r for r in rows}
    bars: dict[tuple, int] = {}
    for r in rows:
        bars[(r.strategy, r.rank, r.phase)] = bars.get((r.strategy, r.rank, r.phase), 0) + r.measured
    unit, size = unit_for(max(bars.values(), default=0), min_multiple=2)  # at least 2 units: readable ticks
    for ax, strategy in zip(axes, strategies):
        n = len(ranks[strategy])
        width = 0.8 / n
        for g, phase in enumerate(COLUMNS):
            for i, rank in enumerate(ranks[strategy]):
                x = g - 0.4 + width * (i + 0.5)
                bottom = predicted_bottom = 0
                for category in STACK:
                    row = by_key.get((strategy, rank, phase, category))
                    if row is None:
                        continue
                    if row.measured:
                        ax.bar(x, row.measured / size, width * 0.9, bottom=bottom, color=CATEGORY_COLORS[category])
                    bottom += row.measured / size
                    if row.predicted:
                        ax.add_patch(Rectangle((x - width * 0.45, predicted_bottom), width * 0.9, row.predicted / size,
                                               fill=False, edgecolor="black", linestyle="--", linewidth=0.8))
                    predicted_bottom += (row.predicted or 0) / size
        ax.set_xticks(range(len(COLUMNS)), COLUMNS, fontsize=8, rotation=30)
        ax.set_title(f"{strategy} ({n} ranks)", fontsize=10)
        ax.set_xlabel("ranks 0..N-1 left to right in each phase", fontsize=7)
    axes[0].set_ylabel(f"{unit} per rank")
    names = names or {c: c for c in STACK}
    handles = [Patch(color=CATEGORY_COLORS[c], label=names[c]) for c in STACK]
    handles.append(Patch(fill=False, edgecolor="black", linestyle="--", label="predicted"))
    # One row of 7 entries is wider than a one-strategy figure: two rows there.
    columns = len(handles) if len(strategies) > 1 else (len(handles) + 1) // 2
    fig.legend(handles=handles, loc="outside lower center", ncol=columns, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    return fit_figure(fig)
