"""`python -m course_lib.launcher.cell_script`: a lesson's %%torchrun cell written out runs with launch/local.sh."""

import pathlib
import subprocess
import sys

import pytest

from course_lib.launcher.cell_script import main, script_of, torchrun_cells
from launch_helpers import LAUNCH, ROOT, launch_env, run_all

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_torchrun_cell_writes_a_script_that_compiles(notebook, tmp_path):
    for cell in torchrun_cells(notebook):
        out = tmp_path / f"cell{cell.number}.py"
        assert main([str(notebook), "--cell", str(cell.number), "-o", str(out)]) == 0
        text = out.read_text()
        restarts = f"MAX_RESTARTS={cell.max_restarts} " if cell.max_restarts else ""
        assert text.splitlines()[1] == f"# Run: {restarts}NPROC={cell.nproc} bash launch/local.sh {out}"
        compile(text, str(out), "exec")


def test_a_cell_with_max_restarts_is_run_with_them():
    # Lesson 07's restart cell fails without torchrun's restart: the hint must carry it.
    [cell] = [c for c in torchrun_cells(ROOT / "notebooks" / "07_checkpointing.ipynb") if "--max-restarts" in c.options]
    assert cell.max_restarts == 1
    text = script_of(ROOT / "notebooks" / "07_checkpointing.ipynb", cell, pathlib.Path("restart.py"))
    assert text.splitlines()[1:3] == ["# Run: MAX_RESTARTS=1 NPROC=2 bash launch/local.sh restart.py",
                                      "#  or: torchrun --standalone --nproc-per-node 2 --max-restarts=1 restart.py"]


def test_listing_and_bad_input(capsys):
    notebook = ROOT / "notebooks" / "00_setup.ipynb"
    assert main([str(notebook)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split()[:4] == ["1", "%%torchrun", "-n", "2"]
    assert listing[-1].startswith("write one out: python -m course_lib.launcher.cell_script")
    assert main([str(notebook), "--cell", "99"]) == 2
    assert "has %%torchrun cells 1 to" in capsys.readouterr().err
    assert main([str(ROOT / "no_such.ipynb")]) == 2


@pytest.mark.slow
def test_lesson_00_first_cell_runs_under_local_sh(tmp_path):
    script = tmp_path / "first_cell.py"
    subprocess.run([sys.executable, "-m", "course_lib.launcher.cell_script", "notebooks/00_setup.ipynb",
                    "--cell", "1", "-o", str(script)], cwd=ROOT, check=True, timeout=60, capture_output=True)
    run = run_all([["bash", str(LAUNCH / "local.sh"), str(script)]], launch_env(NPROC="2"), timeout_s=120)
    assert run.returncodes == [0], run.explain()
    assert not run.leftovers, run.leftovers
    lines = run.text.splitlines()
    assert "[rank0]:[torchrun] 2 ranks, backend gloo on cpu (no CUDA GPU found)" in lines
    # The cell's all_reduce: 1 + 2 on both ranks, as in the notebook.
    assert "[rank0]:rank 0 of 2: after  all_reduce 3.0" in lines and "[rank1]:rank 1 of 2: after  all_reduce 3.0" in lines
