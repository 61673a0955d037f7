"""Fast single-process tests of the explorers (course_lib.draw.widgets), the ring stepper's states
(course_lib.draw.ring) and show_collective (course_lib.draw.collectives).

    .venv/bin/pytest -p no:cacheprovider -q -o addopts="" tests/test_widgets.py
"""

from __future__ import annotations

import base64
import gc
import random

import pytest
import torch

from course_lib import theory
from course_lib.draw.collectives import show_collective
from course_lib.draw.figures import overflow_inches, png_bytes
from course_lib.draw.ring import draw_ring_state, ring_states
from course_lib.draw.widgets import DPI, memory_comparison, memory_explorer, ring_allreduce_stepper
from course_lib.vocabulary import STAGE_LABELS

# Figures and widgets must build headless with no warning at all.
pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture(autouse=True)
def _collect_earlier_garbage():
    # A file an earlier test left to the garbage collector would warn (ResourceWarning) inside
    # these tests, where warnings are errors: collect it before they start.
    gc.collect()

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _g(nbytes: float) -> str:
    """A number as the explorer's table writes it (GB, 4 significant digits)."""
    return f"{nbytes / 1e9:.4g}"


def test_memory_explorer_bundle_has_png_and_numbers():
    box = memory_explorer(num_params=7e9, world_size=8, strategy="fsdp")
    bundle, metadata = box._repr_mimebundle_()
    assert WIDGET_VIEW in bundle  # JupyterLab still gets the live widget
    assert base64.b64decode(bundle["image/png"]).startswith(PNG_SIGNATURE)
    assert base64.b64decode(bundle["image/png"]) == box.png == box.image.value
    text = bundle["text/plain"]
    assert "Image(" not in text and "VBox(" not in text  # not ipywidgets' repr
    fsdp = theory.zero_memory_per_rank(7_000_000_000, 8, stage=3, precision="bf16-mixed", optimizer="adam")
    ddp = theory.zero_memory_per_rank(7_000_000_000, 8, stage=0, precision="bf16-mixed", optimizer="adam")
    fsdp_line = next(line for line in text.splitlines() if line.startswith("ZeRO-3/FSDP"))
    assert fsdp_line.split()[1:5] == [_g(fsdp.params), _g(fsdp.grads), _g(fsdp.optimizer), _g(fsdp.total)]
    assert fsdp_line.endswith("<- chosen")
    assert _g(ddp.total) in next(line for line in text.splitlines() if line.startswith("DDP"))
    assert box._repr_mimebundle_()[0]["text/plain"] == text  # deterministic: nbval compares it
    assert "bf16-mixed" in text.splitlines()[0] and "bf16-mixed" in box.figure.get_suptitle()


def test_memory_explorer_controls_update_data_and_image():
    box = memory_explorer(num_params=7e9, world_size=8, strategy="ddp")
    png_before, data_before = box.png, box.data
    assert data_before["strategy"] == "DDP" and data_before["world_size"] == 8
    box.controls["world_size"].value = 64
    assert box.data["world_size"] == 64 and box.png != png_before and box.image.value == box.png
    zero3 = theory.zero_memory_per_rank(7_000_000_000, 64, stage=3, precision="bf16-mixed", optimizer="adam")
    assert box.data["memory"]["ZeRO-3/FSDP"]["total"] == zero3.total
    box.controls["strategy"].value = 2
    assert box.data["strategy"] == "ZeRO-2"
    assert next(line for line in box.text.splitlines() if line.endswith("<- chosen")).startswith("ZeRO-2")
    box.controls["model"].value = 70_000_000_000
    box.controls["precision"].value = "fp32"
    assert box.data["num_params"] == 70_000_000_000 and box.data["bytes_per_param"]["params"] == 4
    assert box.text.startswith("70B parameters on 64 ranks, fp32, adam")


def test_memory_comparison_follows_theory_and_zero_paper():
    n, world = 1_300_000_000, 16
    data = memory_comparison(n, world, precision="bf16-mixed", optimizer="adam")
    for stage, label in enumerate(STAGE_LABELS):
        expected = theory.zero_memory_per_rank(n, world, stage=stage, precision="bf16-mixed", optimizer="adam")
        assert data["memory"][label]["total"] == expected.total
    grad_bytes = n * theory.bytes_per_param(precision="bf16-mixed", optimizer="adam").grads
    assert data["comm_total"]["DDP"] == theory.ring_all_reduce_bytes(grad_bytes, world)
    # ZeRO paper, section 7: stages 1-2 move what DDP moves, stage 3 1.5 times that.
    assert data["comm_total"]["ZeRO-1"] == pytest.approx(data["comm_total"]["DDP"])
    assert data["comm_total"]["ZeRO-3/FSDP"] == pytest.approx(1.5 * data["comm_total"]["DDP"])


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


@pytest.mark.parametrize("make", [lambda: memory_explorer(num_params=7e9, world_size=8),
                                  lambda: ring_allreduce_stepper(world_size=4)], ids=["memory", "ring"])
def test_explorer_image_keeps_its_size_and_aspect_and_is_sharp(make):
    box = make()
    width, height = box.css_size
    # Displayed at the figure's own size (a VBox would stretch a width-less image: blurry),
    # shrunk with its aspect kept when the notebook is narrower.
    assert (box.image.layout.width, box.image.layout.max_width, box.image.layout.height) == (
        f"{width}px", "100%", "auto")
    # Two PNG pixels per CSS px: sharp on a HiDPI screen; the static fallback is shown at the same size.
    assert DPI == 200 and _png_size(box.png) == (2 * width, 2 * height)
    assert box._repr_mimebundle_()[1] == {"image/png": {"width": width, "height": height}}


def test_memory_explorer_labels_are_readable():
    box = memory_explorer(num_params=70e9, world_size=1, strategy="ddp")
    bars = [t.get_text() for t in box.figure.axes[0].texts]
    assert bars[:4] == ["1120 GB"] * 4  # was "1.12e+03"
    assert box.text.startswith("70B parameters on 1 rank,") and "e+" not in box.text
    # Each strategy button as wide as its label: a fixed 90px cut "ZeRO-3/FSDP" to "ZeRO-3/…".
    strategy = box.controls["strategy"]
    assert strategy.style.button_width == "auto" and strategy._options_labels == STAGE_LABELS
    for world_size in (1, 8, 1024):
        box.controls["world_size"].value = world_size
        assert overflow_inches(box.figure) == 0.0, world_size


def test_memory_explorer_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        memory_explorer(strategy="pipeline")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_states_sum_everywhere_and_one_chunk_per_rank_per_step(world_size):
    rng = random.Random(world_size)
    values = [[rng.randint(-50, 50) for _ in range(world_size)] for _ in range(world_size)]
    sums = [sum(values[r][c] for r in range(world_size)) for c in range(world_size)]
    states = ring_states(values, world_size)
    assert len(states) == 2 * (world_size - 1) + 1
    assert states[0].values == values and states[0].transfers == []
    for state in states[1:]:
        assert sorted(s for s, _, _ in state.transfers) == list(range(world_size))  # every rank sends once
        assert sorted(d for _, d, _ in state.transfers) == list(range(world_size))  # and receives once
        assert all(d == (s + 1) % world_size for s, d, _ in state.transfers)  # to its ring neighbour
    # After reduce-scatter each rank owns exactly one finished chunk, a different one per rank.
    middle = states[world_size - 1]
    finished = [[c for c in range(world_size) if middle.sources[r][c] == tuple(range(world_size))]
                for r in range(world_size)]
    assert all(len(f) == 1 for f in finished) and sorted(f[0] for f in finished) == list(range(world_size))
    assert all(middle.values[r][finished[r][0]] == sums[finished[r][0]] for r in range(world_size))
    assert states[-1].values == [sums] * world_size
    assert all(s == tuple(range(world_size)) for row in states[-1].sources for s in row)


def test_ring_states_rejects_wrong_shape():
    with pytest.raises(ValueError, match="3 ranks x 3 chunks"):
        ring_states([[1, 2], [3, 4], [5, 6]], 3)


def test_ring_stepper_slider_moves_state_and_png():
    box = ring_allreduce_stepper(3)
    assert box.data["step"] == 0 and box.text.splitlines()[1] == "rank 0: [1, 2, 3]"
    first_png = box.png
    box.controls["step"].value = 4
    assert box.data["state"] is box.data["states"][-1] and box.png != first_png
    assert box._repr_mimebundle_()[0]["text/plain"].splitlines()[1:] == [
        "rank 0: [111, 222, 333]", "rank 1: [111, 222, 333]", "rank 2: [111, 222, 333]"]
    assert png_bytes(draw_ring_state(box.data["states"][1], num_steps=4)).startswith(PNG_SIGNATURE)


def test_show_collective_all_gather_provenance(capsys):
    # What a lesson publishes: the input tensor, and the list dist.all_gather filled.
    before = {r: torch.tensor([10.0 * r, 10.0 * r + 1]) for r in range(3)}
    after = {r: [before[s].clone() for s in range(3)] for r in range(3)}
    view = show_collective("all_gather", before, after)
    assert view.after[1] == [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]
    assert view.provenance[2] == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)], [(2, 0)], [(2, 1)]]
    assert view.source_ranks[0] == [(0,), (0,), (1,), (1,), (2,), (2,)]
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: [0, 1] -> [0, 1, 10, 11, 20, 21]", "rank 1: [10, 11] -> [0, 1, 10, 11, 20, 21]",
        "rank 2: [20, 21] -> [0, 1, 10, 11, 20, 21]"]
    assert png_bytes(view.figure).startswith(PNG_SIGNATURE)


def test_show_collective_reduce_scatter_provenance_and_op():
    before = {0: [1, 2, 3, 4], 1: [10, 20, 30, 40]}
    after = {0: [11, 22], 1: [33, 44]}
    view = show_collective("reduce_scatter_tensor", before, after, quiet=True)
    assert view.op == "reduce_scatter" and view.reduce_op == "sum"
    assert view.provenance[1] == [[(0, 2), (1, 2)], [(0, 3), (1, 3)]]
    assert view.source_ranks[1] == [(0, 1), (0, 1)]
    maxed = show_collective("reduce_scatter", before, {0: [10, 20], 1: [30, 40]}, quiet=True)
    assert maxed.reduce_op == "max"


def test_show_collective_broadcast_root_and_wrong_value():
    before = {0: [1, 1], 1: [7, 8], 2: [3, 3]}
    view = show_collective("broadcast", before, {r: [7, 8] for r in range(3)}, quiet=True)
    assert view.root == 1 and view.provenance[0] == [[(1, 0)], [(1, 1)]]
    # A rank that ended with something else: its cell is left grey, not drawn as a copy.
    wrong = show_collective("broadcast", before, {0: [7, 8], 1: [7, 8], 2: [7, 9]}, root=1, quiet=True)
    assert wrong.provenance[2] == [[(1, 0)], None] and wrong.source_ranks[2] == [(1,), ()]


def test_show_collective_unknown_op_is_plain_and_ranks_must_match():
    view = show_collective("send", {0: [1], 1: [0]}, {0: [1], 1: [1]}, quiet=True)
    assert view.provenance == {0: [None], 1: [None]}
    with pytest.raises(ValueError, match=r"before has ranks \[0, 1\], after has ranks \[0\]"):
        show_collective("all_reduce", {0: [1], 1: [2]}, {0: [3]})
