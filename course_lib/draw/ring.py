"""Ring all-reduce step by step: what every rank holds after each of its 2(N-1) steps.

Each rank's tensor is cut into N chunks (one number per chunk here). In the
reduce-scatter phase (N-1 steps) every rank sends one chunk to the next rank,
which adds it to its own; afterwards rank r holds the full sum of one chunk. In
the all-gather phase (N-1 more steps) the finished chunks travel round the ring
and are copied. Each rank sends 2(N-1) chunks of size 1/N: 2(N-1)/N of the
tensor, whatever N (Patarasuk & Yuan 2009; the algorithm NCCL and gloo use for
large tensors). The transfers come from `theory.ring_all_reduce_schedule`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .collectives import draw_cell, format_values
from .figures import new_figure, rank_color

__all__ = ["RingState", "default_ring_values", "draw_ring_state", "ring_states", "ring_text"]


@dataclasses.dataclass(frozen=True)
class RingState:
    """The ring after `step` steps (0: before any transfer).

    `values[rank][chunk]` is what that rank holds for that chunk; `sources[rank][chunk]`
    the ranks whose input it already includes; `transfers` the (src, dst, chunk)
    sends of this step; `phase` the schedule's name for it ("start" at step 0).
    """

    step: int
    phase: str
    values: list[list]
    sources: list[list[tuple[int, ...]]]
    transfers: list[tuple[int, int, int]]


def default_ring_values(world_size: int) -> list[list[int]]:
    """Rank r holds (c + 1) * 10**r in chunk c: a sum's digits say which ranks it includes (1101: ranks 0, 2, 3)."""
    return [[(c + 1) * 10**r for c in range(world_size)] for r in range(world_size)]


def ring_states(values_per_rank: Sequence[Sequence] | None, world_size: int) -> list[RingState]:
    """Every state of a ring all-reduce of `values_per_rank[r]` (one value per chunk, N chunks per rank).

    Returns 2(N-1) + 1 states; the last holds the element-wise sum on every rank.
    Sends within a step happen at once: each reads the state before the step.
    """
    from .. import theory

    if values_per_rank is None:
        values_per_rank = default_ring_values(world_size)
    rows = [list(v.tolist() if hasattr(v, "tolist") else v) for v in values_per_rank]
    if len(rows) != world_size or any(len(row) != world_size for row in rows):
        raise ValueError(f"ring_states: need {world_size} ranks x {world_size} chunks (one value per chunk), "
                         f"got {[len(row) for row in rows]}")
    values = [list(row) for row in rows]
    sources = [[(r,) for _ in range(world_size)] for r in range(world_size)]
    states = [RingState(0, "start", [list(v) for v in values], [list(s) for s in sources], [])]
    for step, transfers in enumerate(theory.ring_all_reduce_schedule(world_size), start=1):
        old_values, old_sources = [list(v) for v in values], [list(s) for s in sources]
        phase = str(transfers[0][3]) if transfers else ""
        for src, dst, chunk, transfer_phase in transfers:
            if "reduce" in str(transfer_phase):  # reduce-scatter: add the incoming partial sum
                values[dst][chunk] = old_values[dst][chunk] + old_values[src][chunk]
                sources[dst][chunk] = tuple(sorted(set(old_sources[dst][chunk]) | set(old_sources[src][chunk])))
            else:  # all-gather: overwrite with the finished sum
                values[dst][chunk] = old_values[src][chunk]
                sources[dst][chunk] = old_sources[src][chunk]
        states.append(RingState(step, phase, [list(v) for v in values], [list(s) for s in sources],
                                [(s, d, c) for s, d, c, _ in transfers]))
    return states


def ring_text(state: RingState, num_steps: int) -> str:
    """The numbers of one state as text: a header line, then `rank r: [chunk values]`."""
    world_size = len(state.values)
    header = f"ring all-reduce, {world_size} ranks, step {state.step} of {num_steps} ({state.phase})"
    if state.transfers:
        header += ": " + ", ".join(f"{s}->{d} chunk {c}" for s, d, c in state.transfers)
    return "\n".join([header] + [f"rank {r}: {format_values(v)}" for r, v in enumerate(state.values)])


def _title(state: RingState, num_steps: int) -> str:
    if state.step == 0:
        return "start: every rank holds its own N chunks"
    if state.step == num_steps:
        return f"step {state.step} of {num_steps} ({state.phase}): every rank holds the sum of every chunk"
    return f"step {state.step} of {num_steps} ({state.phase}): each rank sends one chunk to the next"


def draw_ring_state(state: RingState, *, num_steps: int) -> Any:
    """Ranks as columns, chunks as rows; a cell's stripes are the ranks its value includes, arrows this step's sends."""
    from matplotlib.patches import FancyArrowPatch, Rectangle
    from matplotlib.path import Path

    n = len(state.values)
    pitch = 1.6  # a column is 1 wide; the gap carries the arrow to the next rank
    fig = new_figure(max(4.8, 0.55 * n * pitch + 1.6), 0.5 * n + 1.8)
    ax = fig.add_subplot()
    received = {(d, c) for _, d, c in state.transfers}
    for r in range(n):
        ax.text(r * pitch + 0.5, 0.95, f"rank {r}", ha="center", fontsize=9, color=rank_color(r))
        for c in range(n):
            y = -c
            draw_cell(ax, r * pitch, y, format_values([state.values[r][c]])[1:-1],
                      [rank_color(s) for s in state.sources[r][c]])
            if (r, c) in received:  # a thick border: this value just arrived
                ax.add_patch(Rectangle((r * pitch, y), 1, 0.8, fill=False, edgecolor="black", lw=2.2))
    for c in range(n):
        ax.text(-0.55, -c + 0.4, f"chunk {c}", ha="right", va="center", fontsize=8)
    for src, dst, c in state.transfers:
        y = -c + 0.4
        if dst == src + 1 or (dst == src - 1 and n > 2):  # next column: a short arrow through the gap
            ends = (src * pitch + 1.02, dst * pitch - 0.02) if dst > src else (src * pitch - 0.02, dst * pitch + 1.02)
            path = Path([(ends[0], y), (ends[1], y)])
        else:  # the wrap between the last rank and rank 0: round the outside, below the grid
            edge = {0: -0.02, n - 1: (n - 1) * pitch + 1.02}
            lane = {0: -0.3, n - 1: (n - 1) * pitch + 1.3}
            bottom = -n + 0.55
            path = Path([(edge[src], y), (lane[src], y), (lane[src], bottom), (lane[dst], bottom),
                         (lane[dst], y), (edge[dst], y)])
        ax.add_patch(FancyArrowPatch(path=path, arrowstyle="-|>", mutation_scale=10, color=rank_color(src), lw=1.4))
    ax.set_xlim(-1.9, (n - 1) * pitch + 1.6)
    ax.set_ylim(-n + 0.3, 1.4)
    ax.set_axis_off()
    ax.set_title(_title(state, num_steps), fontsize=10)
    fig.supxlabel("stripes: the ranks whose values a cell already sums;  thick border: just received",
                  fontsize=7, color="#555555")
    return fig
