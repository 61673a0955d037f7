"""Communication, drawn: a per-rank timeline of the collective ledger, and bytes per step vs theory.

`show_timeline(ledgers)`: one lane per rank, one bar per call from its start to
its end, coloured by op, labelled with its input bytes (inside the bar where it
fits, else above it where no other label is; the printed lines list the bars
too short for either). A hatched bar is an
`async_op=True` call: it "ends" when its work object is created, not when the
transfer does, so its length says nothing about the transfer. Barriers are grey.

`show_comm(table, expected)`: for each step, the bytes each op moved on one
rank (measured, from `comm.comm_table`) beside what theory predicts.

Both print a few lines, display the figure (unless `quiet=True`) and return a
view holding the data drawn and the figure, so tests assert on what the
learner sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..measure.comm import CommTable, Expected, TheoryRow, compare_with_theory, exact_bytes
from ..units import binary_bytes, unit_for
from ..vocabulary import canonical_op
from .figures import new_figure, show

__all__ = ["OP_COLORS", "CommView", "TimelineBar", "TimelineView", "op_color", "show_comm", "show_timeline"]

# The same colour for an op in every figure, keyed by the course's names (vocabulary.canonical_op:
# tests/test_vocabulary.py checks every key is one); others cycle through _SPARE.
OP_COLORS = {
    "all_reduce": "#4c72b0", "all_gather_single": "#55a868", "all_gather": "#8fd19e",
    "reduce_scatter_single": "#dd8452", "reduce_scatter": "#f1b383", "broadcast": "#8172b3",
    "all_to_all_single": "#c44e52", "all_to_all": "#e39b9d", "barrier": "#b0b0b0",
}
_SPARE = ("#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")


def op_color(op: str) -> str:
    op = canonical_op(op)
    return OP_COLORS.get(op) or _SPARE[sum(map(ord, op)) % len(_SPARE)]


@dataclasses.dataclass(frozen=True)
class TimelineBar:
    """One call on one rank; times in seconds from the view's origin. `end` None: still inside the call."""
    rank: int
    seq: int
    op: str
    group: str
    bytes: int
    start: float
    end: float | None
    is_async: bool


@dataclasses.dataclass
class TimelineView:
    bars: list[TimelineBar]
    align: str
    origin: dict[int, float]  # per rank, the ledger time drawn as 0
    lines: list[str]
    fig: Any
    # (rank, seq) -> where its byte label went: "inside" or "above" the bar, or "left out" (in `lines`).
    label_places: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)


LABEL_FONTSIZE = 9  # the axis labels' size (10) less one: readable, horizontal


def _place_labels(fig: Any, ax: Any, drawn: list[tuple[TimelineBar, float, float]]) -> dict[tuple[int, int], str]:
    """Byte labels for `drawn` (bar, left ms, width ms): inside a bar wide enough, else above it if the
    space there is free, else none. Measured in the laid-out figure, so "fits" is what the PNG shows."""
    fig.draw_without_rendering()  # constrained layout: the axes' final size, so pixels are the PNG's
    renderer = fig.canvas.get_renderer()
    axes_box = ax.get_window_extent(renderer)
    above: dict[int, list[tuple[float, float]]] = {}  # per lane, the x extents (px) of labels above bars
    places = {}
    for bar, left, width in drawn:
        text = binary_bytes(bar.bytes, significant=3)
        x0, x1 = (ax.transData.transform((x, bar.rank))[0] for x in (left, left + width))
        label = ax.text(left + width / 2, bar.rank, text, ha="center", va="center", fontsize=LABEL_FONTSIZE,
                        bbox=dict(boxstyle="round,pad=0.1", facecolor="white", alpha=0.75, lw=0))  # on hatching too
        box = label.get_window_extent(renderer)
        if box.width + 4 <= abs(x1 - x0):
            places[(bar.rank, bar.seq)] = "inside"
            continue
        label.remove()
        # Above its bar (rank 0 is the top lane: the y axis runs downwards), if no label is there yet.
        label = ax.text(left + width / 2, bar.rank - 0.27, text, ha="center", va="bottom", fontsize=LABEL_FONTSIZE)
        box = label.get_window_extent(renderer)
        if box.x0 < axes_box.x0 or box.x1 > axes_box.x1:  # at an end of the axis: start/end with the bar
            at_left = box.x0 < axes_box.x0
            label.set_x(left if at_left else left + width)
            label.set_horizontalalignment("left" if at_left else "right")
            box = label.get_window_extent(renderer)
        taken = above.setdefault(bar.rank, [])
        if box.x0 >= axes_box.x0 and box.x1 <= axes_box.x1 and all(
                box.x1 + 4 <= a or box.x0 >= b + 4 for a, b in taken):
            taken.append((box.x0, box.x1))
            places[(bar.rank, bar.seq)] = "above"
        else:
            label.remove()
            places[(bar.rank, bar.seq)] = "left out"
    return places


def _left_out_line(bars: list[TimelineBar], limit: int = 8) -> str:
    named = [f"#{b.seq} {b.op} {binary_bytes(b.bytes, significant=3)}" for b in bars]
    more = f", ... +{len(named) - limit}" if len(named) > limit else ""
    return "  bars too short for their label: " + ", ".join(named[:limit]) + more


def _origins(ledgers: dict[int, list[dict]], align: str) -> dict[int, float]:
    ranks = [r for r in ledgers if ledgers[r]]
    if align == "clock":
        # Ranks on one machine share time.monotonic() (CLOCK_MONOTONIC is system-wide on Linux).
        first = min((ledgers[r][0]["start"] for r in ranks), default=0.0)
        return {r: first for r in ranks}
    if align == "first":
        return {r: ledgers[r][0]["start"] for r in ranks}
    if align == "barrier":
        # Every rank leaves a barrier at (nearly) the same moment: a clock shared across machines.
        ends = {r: next((e["end"] for e in ledgers[r] if e["op"] == "barrier" and e["end"] is not None), None)
                for r in ranks}
        if None in ends.values():
            raise ValueError(f"align='barrier': ranks {[r for r, t in ends.items() if t is None]} have no barrier")
        return ends
    raise ValueError(f"align must be 'clock', 'first' or 'barrier', got {align!r}")


def _of_steps(entries: list[dict], steps: set[int]) -> list[dict]:
    """The entries of `steps`, counted as `comm.split_steps` does; a world barrier goes with the step it opens."""
    step, kept = 0, []
    for entry in entries:
        if entry["op"] == "barrier" and entry["group"] == "world":
            step += 1
        if step in steps:
            kept.append(entry)
    return kept


def show_timeline(ledgers: dict[int, list[dict]], *, steps: list[int] | None = None, align: str = "clock",
                  labels: bool | None = None, title: str = "collectives per rank",
                  shade: dict[int, tuple[float, str]] | None = None, quiet: bool = False) -> TimelineView:
    """Draw each rank's calls on a shared time axis (ms); return a `TimelineView`.

    `steps`: only the calls of these steps (cut at world barriers, as
    `comm.split_steps` does), each with the barrier that opens it.
    `align`: "clock" (one machine's shared monotonic clock, default), "first"
    (each rank from its own first call drawn) or "barrier" (each rank from the
    end of its first barrier). `labels`: bytes on each bar; default when no
    rank has more than 30 calls drawn. `shade`: {rank: (time, label)}, a time
    in the ledger's clock (`time.monotonic()` on the rank) from which that
    rank's lane is shaded and labelled (e.g. when it ran out of data: every
    call after it is a shadow); the printed line of the rank counts the calls
    that started after it.
    """
    if steps is not None:
        ledgers = {r: _of_steps(entries, set(steps)) for r, entries in ledgers.items()}
    origin = _origins(ledgers, align)
    bars = [TimelineBar(r, e["seq"], canonical_op(e["op"]), e["group"], e["bytes"], e["start"] - origin[r],
                        None if e["end"] is None else e["end"] - origin[r], bool(e["async"]))
            for r in sorted(origin) for e in ledgers[r]]
    ranks = sorted(origin)
    span = max([b.end if b.end is not None else b.start for b in bars] + [1e-6])
    if labels is None:
        labels = all(len(ledgers[r]) <= 30 for r in ranks)
    fig = new_figure(8.0, 1.2 + 0.8 * max(len(ranks), 1))
    ax = fig.add_subplot()
    drawn: set[str] = set()
    to_label = []
    for bar in bars:
        end = span if bar.end is None else bar.end
        # A call of a few microseconds is still drawn: at least 0.3% of the axis wide.
        width = max(end - bar.start, span * 0.003) * 1e3
        ax.barh(bar.rank, width, left=bar.start * 1e3, height=0.5, color=op_color(bar.op), edgecolor="black",
                linewidth=0.3, hatch="///" if bar.is_async else None,
                label=None if bar.op in drawn else bar.op)
        drawn.add(bar.op)
        if labels and bar.op != "barrier":
            to_label.append((bar, bar.start * 1e3, width))
    shade = {r: mark for r, mark in (shade or {}).items() if r in origin}
    shade_labels = []
    for r, (at, text) in shade.items():
        from matplotlib.patches import Rectangle

        left = (at - origin[r]) * 1e3
        ax.add_patch(Rectangle((left, r - 0.42), max(span * 1e3 - left, 0.0), 0.84, facecolor="#e6e6e6",
                               edgecolor="#999999", linestyle="--", linewidth=0.6, zorder=0))
        shade_labels.append(ax.text(left, r + 0.4, f" {text}", ha="left", va="bottom",
                                    fontsize=LABEL_FONTSIZE - 1, color="#444444"))
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, -1.2)
    ax.set_xlabel(f"time (ms){' from first call' if align != 'barrier' else ' from first barrier'}; "
                  "hatched: async_op=True (ends when issued)")
    ax.set_title(title, fontsize=10)
    if drawn:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if shade_labels:  # a label that would cross the axis' right end ends there instead
        fig.draw_without_rendering()
        renderer, right = fig.canvas.get_renderer(), ax.get_window_extent().x1
        for label in shade_labels:
            if label.get_window_extent(renderer).x1 > right:
                label.set_x(ax.get_xlim()[1])
                label.set_horizontalalignment("right")
    places = _place_labels(fig, ax, to_label) if to_label else {}
    calls = {r: sum(b.rank == r and b.op != "barrier" for b in bars) for r in ranks}
    lines = []
    for r in ranks:
        after = ""
        if r in shade:
            at, text = shade[r]
            late = sum(b.rank == r and b.op != "barrier" and b.start > at - origin[r] for b in bars)
            after = f"; {late} after '{text}'"
        lines.append(f"rank {r}: {calls[r]} call{'' if calls[r] == 1 else 's'}, "
                     f"{exact_bytes(sum(b.bytes for b in bars if b.rank == r))}{after}")
        left_out = [b for b in bars if b.rank == r and places.get((r, b.seq)) == "left out"]
        if left_out:
            lines.append(_left_out_line(left_out))
    if not quiet:
        print("\n".join(lines))
        show(fig)
    return TimelineView(bars, align, origin, lines, fig, places)


def _calls(n: int) -> str:
    return f"{n} call" + ("" if n == 1 else "s")


@dataclasses.dataclass
class CommView:
    rows: list[TheoryRow]
    lines: list[str]
    fig: Any

    @property
    def match(self) -> bool:
        return all(row.match for row in self.rows)


def show_comm(table: CommTable, expected: Expected, *, rank: int = 0, steps: list[int] | None = None,
              title: str | None = None, quiet: bool = False) -> CommView:
    """Bars of bytes per op per step on `rank`, measured beside predicted; return a `CommView`.

    `expected`: as for `compare_with_theory` ({op: bytes} or [(op, bytes), ...]).
    """
    rows = compare_with_theory(table, expected, ranks=[rank], steps=steps)
    lines = [f"step {r.step} {r.op:<22} measured {exact_bytes(r.measured_bytes):>10} ({_calls(r.measured_count)})"
             f"  predicted {exact_bytes(r.predicted_bytes):>10}"
             + (f" ({_calls(r.predicted_count)})" if r.predicted_count is not None else "")
             + ("" if r.match else "  MISMATCH") for r in rows]
    from matplotlib.patches import Patch

    fig = new_figure(min(14.0, max(5.5, 1.5 + 1.3 * len(rows))), 3.6)
    ax = fig.add_subplot()
    xs = range(len(rows))
    # In a unit with at least 2 of it at the top: tick labels "40", not raw bytes under a "1e7" offset.
    unit, size = unit_for(max([r.measured_bytes for r in rows] + [r.predicted_bytes for r in rows] + [0]),
                          min_multiple=2)
    ax.bar([x - 0.2 for x in xs], [r.measured_bytes / size for r in rows], width=0.4,
           color=[op_color(r.op) for r in rows], edgecolor="black", linewidth=0.5)
    ax.bar([x + 0.2 for x in xs], [r.predicted_bytes / size for r in rows], width=0.4, color="white",
           edgecolor=[op_color(r.op) for r in rows], hatch="///", linewidth=1.0)
    for x, r in zip(xs, rows):
        if not r.match:
            ax.text(x, max(r.measured_bytes, r.predicted_bytes) / size, "≠", ha="center", va="bottom", color="red")
    ax.set_xticks(list(xs), [f"step {r.step}\n{r.op}" for r in rows], fontsize=7)
    ax.set_ylabel(f"input {unit} per step")
    ax.set_title(title or f"rank {rank}: bytes per op per step, measured vs predicted", fontsize=10)
    ax.legend(handles=[Patch(facecolor="#999999", edgecolor="black", label="measured (ledger)"),
                       Patch(facecolor="white", edgecolor="#555555", hatch="///", label="predicted (theory)")],
              fontsize=7)
    if not quiet:
        print("\n".join(lines))
        show(fig)
    return CommView(rows, lines, fig)
