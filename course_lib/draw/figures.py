"""Drawing helpers shared by the visual modules (sharding, memory, communication, ...).

Figures are `matplotlib.figure.Figure` objects built without pyplot: no global
figure registry (so no "too many open figures" warning), no backend to pick,
the same in a notebook, under nbval and in a headless test. `show(fig)`
puts the PNG in the notebook; nbval does not compare images, so a figure
never makes a notebook test flaky, while the numbers printed beside it are
compared.
"""

from __future__ import annotations

import io
from typing import Any

__all__ = ["fit_figure", "new_figure", "overflow_inches", "png_bytes", "rank_color", "show", "CATEGORY_COLORS"]

# One colour per rank, the same in every figure of the course (matplotlib's tab10, then tab20).
_RANK_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
)

# Memory categories, in stacking order, with fixed colours so every memory figure reads the same.
CATEGORY_COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "buffers": "#8172b3",
    "other": "#937860",
}


def rank_color(rank: int) -> str:
    """The colour of `rank` in every figure (cycles after 16 ranks)."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def new_figure(width: float = 6.4, height: float = 4.0) -> Any:
    """A pyplot-free `Figure` of `width` x `height` inches, with an Agg canvas attached."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _overhang(fig: Any) -> tuple[float, float]:
    """(width, height) in inches by which what is drawn reaches past the figure's edges, both sides added."""
    fig.draw_without_rendering()  # constrained layout places everything first
    box = fig.get_tightbbox()
    width, height = fig.get_size_inches()
    return max(0.0, -box.x0) + max(0.0, box.x1 - width), max(0.0, -box.y0) + max(0.0, box.y1 - height)


def overflow_inches(fig: Any) -> float:
    """How far (inches) anything drawn reaches past the figure's edges; 0.0 when all fits.

    `savefig` cuts at the edges: a title or tick label wider than the figure loses its ends in the PNG.
    """
    return max(_overhang(fig))


def fit_figure(fig: Any, *, pad: float = 0.05) -> Any:
    """Widen/heighten `fig` until nothing drawn reaches past its edges (titles, tick labels); returns `fig`.

    Constrained layout gives up (and lets text cross the edge) when the figure is too small for its
    labels; a larger figure lets it lay them out. Sizes with short labels stay as they were.
    """
    for _ in range(4):  # each pass re-lays out; a centred title needs about two
        extra_w, extra_h = _overhang(fig)
        if extra_w <= 0.005 and extra_h <= 0.005:
            break
        width, height = fig.get_size_inches()
        fig.set_size_inches(width + (extra_w + 2 * pad if extra_w > 0.005 else 0),
                            height + (extra_h + 2 * pad if extra_h > 0.005 else 0))
    return fig


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    """Render `fig` to PNG bytes (Agg: works with no display)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def show(fig: Any) -> None:
    """Display `fig` as a PNG in the running notebook; does nothing outside IPython."""
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is None:
        return
    display(Image(data=png_bytes(fig)))
