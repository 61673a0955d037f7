"""Draw a simulation table (course_lib.measure.simulate): memory and traffic per rank against world size.

Everything here says SIMULATED: the printed lines, the figure's title.
"""

from __future__ import annotations

from typing import Any

from ..measure.simulate import GPU_BYTES, LABEL
from ..units import decimal_bytes
from ..vocabulary import LOW_PRECISION_DTYPES

__all__ = ["show_simulation"]

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def _axis_bytes(value: float, _position: Any = None) -> str:
    """Axis label in decimal units, as GPU memory is sold: 80 GB, 500 MB."""
    return decimal_bytes(value)


def show_simulation(rows: list[dict], *, gpu_bytes: float = GPU_BYTES) -> tuple[dict, Any]:
    """Per-rank memory (log-log) and bytes sent per step against world size, titled SIMULATED; returns (data, fig).

    One line per model for its first rank (solid) and, where it differs, its last rank (dashed): the
    padding of the last shards. `data` holds exactly the points drawn, and `data["lines"]` the
    numbers it prints (one line per simulated rank, under the SIMULATED label and the precision).
    """
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from .figures import new_figure, show

    settings = sorted({(row["precision"], row["optimizer"]) for row in rows})
    title = f"SIMULATED FSDP2, {' / '.join(f'{p} + {o}' for p, o in settings)}: per rank (fake process group)"
    data: dict[str, Any] = {"title": title, "label": LABEL, "memory": {}, "sent": {}, "gpu_bytes": gpu_bytes}
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == model]
        first = {n: min(r["rank"] for r in mine if r["world_size"] == n) for n in {r["world_size"] for r in mine}}
        last = {n: max(r["rank"] for r in mine if r["world_size"] == n) for n in first}
        for which, pick in (("first rank", first), ("last rank", last)):
            points = sorted((r["world_size"], r["total_bytes"]) for r in mine if r["rank"] == pick[r["world_size"]])
            if which == "first rank" or points != data["memory"][f"{model}, first rank"]:
                data["memory"][f"{model}, {which}"] = points
        data["sent"][model] = sorted({(r["world_size"], r["sent_bytes"]) for r in mine})
    # The collectives' dtypes said here: they are why FSDP2 sends more than memory_explorer's formula.
    said = [f"{p} ({_SHORT[LOW_PRECISION_DTYPES[p]]} all-gathers, fp32 reduce-scatters)" if p in LOW_PRECISION_DTYPES
            else p for p, _ in settings]
    data["lines"] = [f"SIMULATED, {' / '.join(f'{p} + {o}' for p, (_, o) in zip(said, settings))}: {LABEL}"] + [
        f"{r['model']:>10} on {r['world_size']:>4} ranks, rank {r['rank']:>4}: "
        f"{decimal_bytes(r['total_bytes'], significant=4)} of model state, sends {decimal_bytes(r['sent_bytes'], significant=4)} per step"
        for r in sorted(rows, key=lambda r: (r["model"], r["world_size"], r["rank"]))]
    print("\n".join(data["lines"]))
    fig = new_figure(11, 4.2)
    memory_ax, sent_ax = fig.subplots(1, 2)
    models = list(data["sent"])
    for name, points in data["memory"].items():
        model, which = name.rsplit(", ", 1)
        memory_ax.plot(*zip(*points), "-" if which == "first rank" else "--", marker="o",
                       color=f"C{models.index(model)}", label=name)
    memory_ax.axhline(gpu_bytes, color="grey", linestyle=":", label=f"{decimal_bytes(gpu_bytes)}: one H100")
    for model, points in data["sent"].items():
        sent_ax.plot(*zip(*points), "-", marker="o", color=f"C{models.index(model)}", label=model)
    world_sizes = sorted({row["world_size"] for row in rows})
    for ax, what in ((memory_ax, "params + grads + optimizer state per rank"), (sent_ax, "bytes sent per rank per step (ring)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(world_sizes, [str(n) for n in world_sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(_axis_bytes))
        ax.set_xlabel("world size (ranks)")
        ax.set_title(what, fontsize="medium")
        ax.legend(fontsize="small")
        ax.grid(True, which="major", alpha=0.3)
    memory_ax.set_yscale("log")  # memory falls as 1/N: a straight line on log-log
    memory_ax.yaxis.set_major_formatter(FuncFormatter(_axis_bytes))
    values = [b for points in data["memory"].values() for _, b in points] + [gpu_bytes]
    # Within one decade a log axis has at most one major tick: label the minor ones (20 GB, 30 GB, ...).
    memory_ax.yaxis.set_minor_formatter(FuncFormatter(_axis_bytes) if max(values) < 10 * min(values)
                                        else NullFormatter())
    sent_ax.set_ylim(bottom=0)  # linear from 0: what a rank sends does not shrink with N
    fig.suptitle(title)
    show(fig)
    return data, fig
