"""Who sent how much to whom: one p x p matrix per step, drawn from a real run (lesson 10's token flow).

`draw_flow(steps)` takes `{step: matrix}` with `matrix[i][j]` what rank i sent to rank j (tokens, rows,
bytes: any count), as the ranks' own counts give it. It prints each matrix with its row sums (what each
rank sent) and column sums (what each rank received: its work, for a layer that computes on what it
receives), draws one heat map per step, the numbers in the cells, and returns a `FlowView` with the same
numbers, so a cell asserts on what the learner sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from .figures import new_figure, show

__all__ = ["FlowView", "draw_flow"]


@dataclasses.dataclass
class FlowView:
    matrices: dict[Any, list[list[int]]]   # {step: [[sent by i to j]]}
    sent: dict[Any, list[int]]             # {step: row sums}
    received: dict[Any, list[int]]         # {step: column sums}
    lines: list[str]                       # what was printed
    fig: Any


def _checked(steps: Mapping[Any, Sequence[Sequence[int]]]) -> dict[Any, list[list[int]]]:
    if not steps:
        raise ValueError("draw_flow: no steps (pass {step: matrix}, matrix[i][j] = what rank i sent to rank j)")
    out = {}
    for step, matrix in steps.items():
        rows = [[int(v) for v in row] for row in matrix]
        p = len(rows)
        if p == 0 or any(len(row) != p for row in rows):
            raise ValueError(f"draw_flow: step {step!r}: the matrix must be p x p (rank i's row, rank j's column)")
        if any(v < 0 for row in rows for v in row):
            raise ValueError(f"draw_flow: step {step!r}: a negative count")
        out[step] = rows
    if len({len(m) for m in out.values()}) != 1:
        raise ValueError("draw_flow: every step's matrix must have the same number of ranks")
    return out


def _table(step: Any, matrix: list[list[int]], unit: str) -> list[str]:
    p = len(matrix)
    width = max(6, *(len(f"{v:,}") + 1 for row in matrix for v in row), len(f"{sum(map(sum, matrix)):,}") + 1)
    lines = [f"step {step}: {unit} sent (row: from rank, column: to rank)",
             "from \\ to" + "".join(f"{j:>{width}}" for j in range(p)) + f"{'sent':>{width + 2}}"]
    for i, row in enumerate(matrix):
        lines.append(f"{'rank ' + str(i):>9}" + "".join(f"{v:>{width},}" for v in row) + f"{sum(row):>{width + 2},}")
    lines.append(f"{'received':>9}" + "".join(f"{sum(r[j] for r in matrix):>{width},}" for j in range(p)))
    return lines


def draw_flow(steps: Mapping[Any, Sequence[Sequence[int]]], *, title: str = "token flow", unit: str = "tokens",
              quiet: bool = False) -> FlowView:
    """Print and draw `{step: matrix}` (matrix[i][j]: what rank i sent to rank j); return the numbers.

    Each step: a table with row sums (sent) and column sums (received), and a heat map beside the others.
    """
    matrices = _checked(steps)
    lines: list[str] = []
    for step, matrix in matrices.items():
        lines += _table(step, matrix, unit)
    sent = {s: [sum(row) for row in m] for s, m in matrices.items()}
    received = {s: [sum(row[j] for row in m) for j in range(len(m))] for s, m in matrices.items()}

    p = len(next(iter(matrices.values())))
    top = max((v for m in matrices.values() for row in m for v in row), default=0) or 1
    fig = new_figure(0.4 + (1.0 + 0.45 * p) * len(matrices), 1.3 + 0.45 * p)
    axes = fig.subplots(1, len(matrices), squeeze=False)[0]
    for ax, (step, matrix) in zip(axes, matrices.items()):
        ax.imshow(matrix, cmap="Blues", vmin=0, vmax=top)
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:,}", ha="center", va="center", fontsize=8,
                        color="white" if v > 0.6 * top else "black")
        ax.set_xticks(range(p), [str(j) for j in range(p)], fontsize=7)
        ax.set_yticks(range(p), [str(i) for i in range(p)], fontsize=7)
        ax.set_xlabel("to rank", fontsize=8)
        ax.set_title(f"step {step}", fontsize=9)
    axes[0].set_ylabel("from rank", fontsize=8)
    fig.suptitle(f"{title} ({unit})", fontsize=10)
    if not quiet:
        print("\n".join(lines))
        show(fig)
    return FlowView(matrices, sent, received, lines, fig)
