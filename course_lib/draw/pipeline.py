"""A pipeline schedule, drawn from a real run: one row per rank, a box per forward and backward.

`draw_schedule(timelines)` takes what the ranks published, `{rank: [(kind, microbatch, start_s, end_s),
...]}`, kind "F" (forward), "B" (backward) or "W" (weight gradient, for zero-bubble schedules), times from
each rank's `time.monotonic()`. Other timelines name their own kinds: `kinds={"C": ("#9ecae1", "compute"),
...}` (colour, legend name), and the second field is then any step index (lesson 09's ring steps). Ranks on one machine share that clock (CLOCK_MONOTONIC is system-wide on
Linux; the collective ledger uses it too), so their boxes line up on one axis. Ranks on several nodes do not
share it: their clocks differ by an unknown offset, and a drawing across nodes needs a common reference
first (e.g. each rank's end of one barrier, as `show_timeline(align="barrier")` does).

It prints each rank's actions in the order it ran them (stable from run to run: checked under nbval),
draws the boxes (time from the earliest start; gaps are idle time, waiting for a neighbour; a box too
narrow for its microbatch's number goes without it), and returns a
`ScheduleView` whose `stats` hold, per rank, the busy seconds, the idle seconds between its first and last
action, and its bubble: the share of the whole run (earliest start to latest end, over all ranks) it spent
idle, the quantity the textbook's `(p - 1) / (m + p - 1)` predicts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from .figures import new_figure, show

__all__ = ["KIND_COLORS", "PIPELINE_KINDS", "RankStats", "ScheduleBox", "ScheduleView", "draw_schedule"]

# Forward light, backward dark, weight-gradient green: the colours of the papers' schedule figures.
KIND_COLORS = {"F": "#9ecae1", "B": "#3182bd", "W": "#74c476"}
PIPELINE_KINDS = {"F": (KIND_COLORS["F"], "forward"), "B": (KIND_COLORS["B"], "backward"),
                  "W": (KIND_COLORS["W"], "weight gradient")}


def _dark(colour: str) -> bool:
    """Whether a "#rrggbb" colour is dark enough for a white label (relative luminance under 0.5)."""
    r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5


@dataclasses.dataclass(frozen=True)
class ScheduleBox:
    """One action on one rank; times in seconds from the earliest start of the run."""
    rank: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class RankStats:
    busy_s: float       # the sum of its boxes' lengths
    idle_s: float       # between its first start and its last end, not in a box
    bubble: float       # idle share of the whole run: 1 - busy / (latest end - earliest start, all ranks)
    order: tuple[str, ...]  # its actions in the order it started them: ("F0", "F1", "B1", ...)


@dataclasses.dataclass
class ScheduleView:
    boxes: list[ScheduleBox]
    stats: dict[int, RankStats]
    span_s: float        # latest end - earliest start, over all ranks
    lines: list[str]     # what was printed: each rank's order of actions
    fig: Any

    @property
    def bubble(self) -> float:
        """The mean of the ranks' bubbles: the share of all ranks' time in the run spent idle."""
        return sum(s.bubble for s in self.stats.values()) / max(len(self.stats), 1)


def _checked(timelines: Mapping[int, Sequence], kinds: Mapping[str, Any]) -> dict[int, list[tuple[str, int, float, float]]]:
    if not timelines:
        raise ValueError("draw_schedule: no timelines (publish {rank: [(kind, microbatch, start, end), ...]})")
    out = {}
    for rank, actions in timelines.items():
        rows = []
        for action in actions:
            if len(action) != 4:
                raise ValueError(f"draw_schedule: rank {rank}: {action!r} is not (kind, microbatch, start, end)")
            kind, microbatch, start, end = action
            if kind not in kinds:
                raise ValueError(f"draw_schedule: rank {rank}: kind {kind!r}, expected one of {list(kinds)}")
            if end < start:
                raise ValueError(f"draw_schedule: rank {rank}: {kind}{microbatch} ends before it starts")
            rows.append((kind, int(microbatch), float(start), float(end)))
        out[int(rank)] = sorted(rows, key=lambda row: row[2])
    return out


def draw_schedule(timelines: Mapping[int, Sequence], *, title: str = "pipeline schedule",
                  quiet: bool = False, kinds: Mapping[str, tuple[str, str]] | None = None) -> ScheduleView:
    """Draw each rank's forwards and backwards on one time axis (ms); print their order; return the data.

    `timelines`: {rank: [(kind, microbatch, start_s, end_s), ...]} in `time.monotonic()` seconds, as the
    ranks of one machine published them (see the module's docstring for several machines). `kinds`:
    {kind: (colour "#rrggbb", legend name)}, the pipeline's F, B and W unless given. `stats[rank].busy_s` is the
    time in any drawn kind (a kind drawn for waiting counts too); white space is time in none of them.
    """
    kinds = PIPELINE_KINDS if kinds is None else kinds
    if not kinds or not all(isinstance(v, tuple) and len(v) == 2 and re.fullmatch(r"#[0-9a-fA-F]{6}", str(v[0]))
                            for v in kinds.values()):
        raise ValueError('draw_schedule: kinds maps each kind to (colour "#rrggbb", legend name)')
    drawn_pipeline = kinds is PIPELINE_KINDS
    rows = _checked(timelines, kinds)
    ranks = sorted(rows)
    actions = [row for rank in ranks for row in rows[rank]]
    origin = min((start for _, _, start, _ in actions), default=0.0)
    span = max((end for _, _, _, end in actions), default=origin) - origin
    boxes = [ScheduleBox(rank, kind, mb, start - origin, end - origin)
             for rank in ranks for kind, mb, start, end in rows[rank]]
    stats = {}
    for rank in ranks:
        mine = [b for b in boxes if b.rank == rank]
        busy = sum(b.end - b.start for b in mine)
        between = (max(b.end for b in mine) - min(b.start for b in mine)) if mine else 0.0
        stats[rank] = RankStats(busy_s=busy, idle_s=max(between - busy, 0.0),
                                bubble=(1.0 - busy / span) if span > 0 else 0.0,
                                order=tuple(f"{b.kind}{b.microbatch}" for b in mine))
    lines = [f"rank {rank}: {' '.join(stats[rank].order)}" for rank in ranks]

    fig = new_figure(9.0, 1.0 + 0.55 * max(len(ranks), 1))
    ax = fig.add_subplot()
    for box in boxes:
        width = (box.end - box.start) * 1e3
        ax.barh(box.rank, max(width, span * 1e3 * 0.002), left=box.start * 1e3, height=0.7,
                color=kinds[box.kind][0], edgecolor="black", linewidth=0.4)
        # The microbatch's number, in the box where it fits (about 1% of the axis a digit); white on dark.
        label = str(box.microbatch)
        if width >= span * 1e3 * 0.011 * len(label):
            ax.text(box.start * 1e3 + width / 2, box.rank, label, ha="center", va="center",
                    fontsize=7, color="white" if _dark(kinds[box.kind][0]) else "black")
    from matplotlib.patches import Patch

    shown = [k for k in kinds if any(b.kind == k for b in boxes)]
    ax.legend(handles=[Patch(facecolor=kinds[k][0], edgecolor="black", label=kinds[k][1]) for k in shown],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, min(ranks, default=0) - 0.6)  # rank 0 on top
    ax.set_xlim(0, span * 1e3 if span > 0 else 1.0)
    ax.set_xlabel("time (ms) from the first action; white space: "
                  + ("the rank waits (idle)" if drawn_pipeline else "none of the kinds drawn"))
    ax.set_title(title, fontsize=10)
    if not quiet:
        print("\n".join(lines))
        show(fig)
    return ScheduleView(boxes, stats, span, lines, fig)
