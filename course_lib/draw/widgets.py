"""Interactive explorers (ipywidgets) that still show their figure and numbers where widgets cannot run.

`memory_explorer()` compares per-rank model-state memory and per-step traffic
of DDP and ZeRO-1/2/3 (FSDP) as the model, world size and precision change;
`ring_allreduce_stepper()` steps through a ring all-reduce. Numbers come from
`course_lib.theory`.

Every explorer is a `StaticFallbackBox`: its display bundle carries the live
widget view for JupyterLab and also `image/png` of the current figure and a
`text/plain` summary of its numbers. A front-end without the widget manager
(GitHub, nbconvert to HTML without widget state, an untrusted notebook) shows
the PNG; nbval compares the text and skips the widget view and the PNG, so a
notebook with an explorer in it passes under nbval run after run. The figure
goes through a `widgets.Image` (PNG bytes), not an `Output` widget, so no
output capture is involved.
"""

from __future__ import annotations

import base64
from typing import Any, Callable

import ipywidgets as widgets

from ..measure.simulate import GPU_BYTES
from ..units import decimal_bytes, readable_number, unit_for
from ..vocabulary import DEFAULT_PRECISION, OPTIMIZERS, PRECISIONS, STAGE_LABELS, zero_stage
from .figures import CATEGORY_COLORS, new_figure, png_bytes

__all__ = ["StaticFallbackBox", "memory_comparison", "memory_explorer", "ring_allreduce_stepper"]

MODEL_PRESETS = (("125M", 125_000_000), ("1.3B", 1_300_000_000), ("7B", 7_000_000_000),
                 ("13B", 13_000_000_000), ("70B", 70_000_000_000))
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_OP_COLORS = {"all_reduce": "#8172b3", "reduce_scatter": "#c44e52", "all_gather": "#4c72b0"}
_STAGE_TIPS = ("everything replicated", "optimizer state sharded", "optimizer state and gradients sharded",
               "optimizer state, gradients and parameters sharded")
# A figure is drawn 100 CSS px per inch, as `figures.show` displays one, from a PNG of twice
# that: sharp on a HiDPI screen too. The widget's own CSS (max-width 100%, height auto) then
# shrinks it, aspect kept, in a narrow notebook.
CSS_PX_PER_INCH = 100
DPI = 2 * CSS_PX_PER_INCH


class StaticFallbackBox(widgets.VBox):
    """Controls above a figure; redrawn by `render(**control values) -> (data, figure, text)` on every change.

    `.data`, `.figure`, `.text` and `.png` describe what is shown now;
    `.controls` maps names to the control widgets (set `.value` to drive it).
    The image keeps the figure's size and aspect: `.css_size` (width, height) in CSS px.
    """

    def __init__(self, controls: dict[str, widgets.Widget], render: Callable[..., tuple[dict, Any, str]],
                 **kwargs: Any):
        self.image = widgets.Image(format="png")
        bar = widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([bar, self.image], **kwargs)
        self.controls = controls
        self._render = render
        for control in controls.values():
            control.observe(self._refresh, names="value")
        self._refresh()

    def _refresh(self, change: Any = None) -> None:
        self.data, self.figure, self.text = self._render(**{name: c.value for name, c in self.controls.items()})
        self.png = png_bytes(self.figure, dpi=DPI)
        width, height = (round(inches * CSS_PX_PER_INCH) for inches in self.figure.get_size_inches())
        self.css_size = (width, height)
        # A VBox stretches a child without a width to the box's width: an explicit one keeps the
        # figure's size (no upscaling blur), `height: auto` its aspect when max-width shrinks it.
        self.image.layout = widgets.Layout(width=f"{width}px", max_width="100%", height="auto")
        self.image.value = self.png

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict]:
        # ipywidgets 8 gives {"text/plain": repr(self), widget-view+json}; repr would list the
        # children, PNG bytes included. JupyterLab prefers the widget view (renderer rank -10).
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = self.text
        bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
        # The PNG has 2 pixels per CSS px: its width/height metadata shows it at the widget's size.
        width, height = self.css_size
        return bundle, {"image/png": {"width": width, "height": height}}


def _human(n: float) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{readable_number(n / size, 4)}{suffix}"
    return readable_number(n, 4)


def memory_comparison(num_params: int, world_size: int, *, precision: str = DEFAULT_PRECISION,
                      optimizer: str = "adam") -> dict:
    """Per-rank bytes of model state and bytes sent per training step, for every ZeRO stage (`STAGE_LABELS`).

    Memory: `theory.zero_memory_per_rank` (no activations, no padding); traffic:
    `theory.zero_step_sent_bytes` (ring collectives; ZeRO-3 sends 1.5x DDP).
    """
    from .. import theory

    per = theory.bytes_per_param(precision=precision, optimizer=optimizer)
    weights, grads = num_params * per.params, num_params * per.grads
    memory, comm = {}, {}
    for stage, label in enumerate(STAGE_LABELS):
        m = theory.zero_memory_per_rank(num_params, world_size, stage=stage, precision=precision, optimizer=optimizer)
        memory[label] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "total": m.total}
        comm[label] = theory.zero_step_sent_bytes(weights, grads, world_size, stage=stage)
    return {"num_params": num_params, "world_size": world_size, "precision": precision, "optimizer": optimizer,
            "bytes_per_param": {"params": per.params, "grads": per.grads, "optimizer": per.optimizer},
            "memory": memory, "comm": comm, "comm_total": {k: sum(v.values()) for k, v in comm.items()}}


def _memory_view(*, model: int, world_size: int, strategy: int, precision: str, optimizer: str):
    data = memory_comparison(model, world_size, precision=precision, optimizer=optimizer)
    chosen = STAGE_LABELS[strategy]
    data.update(strategy=chosen, stage=strategy)
    unit, scale = unit_for(max(m["total"] for m in data["memory"].values()), decimal=True, units=("GB", "MB"))
    bpp = data["bytes_per_param"]
    lines = [f"{_human(model)} parameters on {_ranks(world_size)}, {precision}, {optimizer}: "
             f"{sum(bpp.values())} bytes per parameter ({bpp['params']} + {bpp['grads']} + {bpp['optimizer']})",
             f"{'strategy':<12}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}{'sent/step':>11}"
             f"  ({unit} per rank)"]
    for label in STAGE_LABELS:
        m = data["memory"][label]
        cells = [m["params"], m["grads"], m["optimizer"], m["total"], data["comm_total"][label]]
        lines.append(f"{label:<12}" + "".join(f"{readable_number(v / scale, 4):>{w}}"
                                              for v, w in zip(cells, (10, 10, 11, 10, 11)))
                     + ("  <- chosen" if label == chosen else ""))
    # Said because cl.simulate_table's FSDP2 sends more in bf16-mixed: it reduce-scatters fp32 gradients.
    lines.append(f"sent/step: ring collectives of {bpp['params']}-byte weights and {bpp['grads']}-byte gradients "
                 "(ZeRO paper, section 7)")
    return data, _draw_memory(data, scale, unit), "\n".join(lines)


def _ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def _draw_memory(data: dict, scale: float, unit: str) -> Any:
    from matplotlib.patches import Patch

    fig = new_figure(10.0, 4.0)
    ax_mem, ax_comm = fig.subplots(1, 2)
    labels = list(STAGE_LABELS)
    for x, label in enumerate(labels):
        style = dict(edgecolor="black", lw=1.5) if label == data["strategy"] else dict(alpha=0.4, lw=0)
        bottom = 0.0
        for key, category in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer")):
            height = data["memory"][label][key] / scale
            ax_mem.bar(x, height, bottom=bottom, color=CATEGORY_COLORS[category], **style)
            bottom += height
        ax_mem.text(x, bottom, f"{readable_number(bottom)} {unit}", ha="center", va="bottom", fontsize=8)
        bottom = 0.0
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            height = data["comm"][label].get(op, 0.0) / scale
            ax_comm.bar(x, height, bottom=bottom, color=_OP_COLORS[op], **style)
            bottom += height
        ax_comm.text(x, bottom, f"{readable_number(bottom)} {unit}", ha="center", va="bottom", fontsize=8)
    if unit == "GB" and max(m["total"] for m in data["memory"].values()) >= 20e9:
        ax_mem.axhline(GPU_BYTES / scale, color="black", ls="--", lw=0.8)  # one H100's memory, for scale
        ax_mem.text(3.45, GPU_BYTES / scale, decimal_bytes(GPU_BYTES), ha="right", va="bottom", fontsize=7)
    keys = ({"parameters": CATEGORY_COLORS["parameters"], "gradients": CATEGORY_COLORS["gradients"],
             "optimizer": CATEGORY_COLORS["optimizer"]}, _OP_COLORS)
    titles = (f"model state per rank ({unit})", f"sent per rank per step ({unit}), ring")
    for ax, title, key in zip((ax_mem, ax_comm), titles, keys):
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.12)
        ax.set_ylim(bottom=0)  # bytes: never below 0, even when every bar is 0 (one rank sends nothing)
        # Below the axes: bars of any height leave no free corner inside.
        ax.legend(handles=[Patch(color=color, label=name) for name, color in key.items()], fontsize=7, ncol=3,
                  loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.suptitle(f"{_human(data['num_params'])} parameters, {_ranks(data['world_size'])}, {data['precision']}, "
                 f"{data['optimizer']}; outlined: {data['strategy']}", fontsize=10)
    return fig


def memory_explorer(*, num_params: float = 7e9, world_size: int = 8, strategy: str = "fsdp",
                    precision: str = DEFAULT_PRECISION, optimizer: str = "adam") -> StaticFallbackBox:
    """Sliders for model size, world size, strategy, precision, optimizer; bars of memory and traffic per rank.

    `strategy`: a name in `vocabulary.ZERO_STAGES` ("ddp", "zero1", "zero2", "zero3", "fsdp", ...) or
    a label ("ZeRO-2"). `.data` is `memory_comparison(...)` plus the chosen strategy; `.text` the table
    that nbval compares.
    """
    stage = zero_stage(strategy)
    presets = dict((value, label) for label, value in MODEL_PRESETS)
    presets.setdefault(int(num_params), _human(num_params))
    sizes = sorted(set(WORLD_SIZES) | {int(world_size)})
    controls = {
        "model": widgets.Dropdown(options=[(label, v) for v, label in sorted(presets.items())], value=int(num_params),
                                  description="model"),
        "world_size": widgets.SelectionSlider(options=sizes, value=int(world_size), description="ranks"),
        # Buttons as wide as their own label: a fixed width cut "ZeRO-3/FSDP" to "ZeRO-3/…".
        "strategy": widgets.ToggleButtons(options=[(label, s) for s, label in enumerate(STAGE_LABELS)], value=stage,
                                          tooltips=list(_STAGE_TIPS), style={"button_width": "auto"}),
        "precision": widgets.Dropdown(options=list(PRECISIONS), value=precision, description="precision"),
        "optimizer": widgets.Dropdown(options=list(OPTIMIZERS), value=optimizer, description="optimizer"),
    }
    return StaticFallbackBox(controls, _memory_view)


def ring_allreduce_stepper(world_size: int = 4, values: list[list] | None = None) -> StaticFallbackBox:
    """A slider over the 2(N-1) steps of a ring all-reduce (`ring.ring_states`); `.data["state"]`: the one shown.

    `values[r][c]`: rank r's value in chunk c (N x N); default `ring.default_ring_values`.
    """
    from .ring import draw_ring_state, ring_states, ring_text

    if not 2 <= world_size <= 8:  # beyond 8 the cells get too small to read
        raise ValueError(f"ring_allreduce_stepper draws 2 to 8 ranks, not {world_size}")
    states = ring_states(values, world_size)
    last = len(states) - 1

    def render(*, step: int):
        state = states[step]
        data = {"world_size": world_size, "step": step, "num_steps": last, "state": state, "states": states}
        return data, draw_ring_state(state, num_steps=last), ring_text(state, last)

    controls = {"step": widgets.IntSlider(value=0, min=0, max=last, description="step")}
    return StaticFallbackBox(controls, render)
