"""The README's example cells run as pasted: every ```python block, in order, in one real kernel."""

from __future__ import annotations

import pathlib
import re

import pytest

from test_magic_kernel import Kernel

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_its_example_cells():
    assert BLOCKS[0].strip() == "%load_ext course_lib"
    assert any(block.startswith("%%torchrun") for block in BLOCKS) and any(b.startswith("%%dist") for b in BLOCKS)


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    kernel = Kernel(tmp_path_factory.mktemp("readme") / "kernel.log")
    try:
        yield [kernel.execute(block, timeout_s=120) for block in BLOCKS] + [kernel.execute("%dist stop")]
    finally:
        kernel.shutdown()


def test_every_readme_cell_runs_without_error(cells):
    for block, cell in zip(BLOCKS, cells):
        errors = [o for o in cell.outputs if o["output_type"] == "error"]
        assert cell.status == "ok" and not errors, f"{block}\n-> {errors or cell.outputs}"
        assert "Traceback" not in cell.text("stderr"), f"{block}\n-> {cell.text('stderr')}"


def test_the_torchrun_example_prints_the_sum_on_every_rank(cells):
    index = next(i for i, block in enumerate(BLOCKS) if block.startswith("%%torchrun"))
    out = cells[index].text("stdout")
    assert "[rank 0] 3.0" in out and "[rank 1] 3.0" in out, out


def test_the_dist_example_sums_on_every_rank(cells):
    index = next(i for i, block in enumerate(BLOCKS) if block.startswith("%%dist"))
    out = cells[index].text("stdout")
    assert "[rank 0] [3.0, 3.0]" in out and "[rank 1] [3.0, 3.0]" in out, out
