"""The GPU script (tests/gpu_node/on_a_gpu.sh -> run_steps.py), its record and the README's table.

The dry run executes the same kinds of step the GPU machine runs (nbval of a lesson, the 1-rank run,
the grader, launch/train.py in each mode, the doctor) on gloo with one notebook's first cells, so
that a GPU machine's minutes are never spent on a typo; it checks the entry's format and that the
README table can be made from it. The record (tests/gpu_node/record.json) and the README's table
must agree.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_NODE = ROOT / "tests" / "gpu_node"
sys.path.insert(0, str(GPU_NODE))

import record_table  # noqa: E402
import steps  # noqa: E402

MACHINE = ("date", "gpu", "torch", "cuda", "nccl", "python")


def test_the_readme_table_is_the_one_the_record_makes():
    record = json.loads(record_table.RECORD.read_text())
    readme = (ROOT / "README.md").read_text()
    assert readme_section(readme) == record_table.table(record), \
        "README's GPU table differs from tests/gpu_node/record.json: python tests/gpu_node/record_table.py --write"


def readme_section(readme: str) -> str:
    return readme.split(record_table.START + "\n", 1)[1].split("\n" + record_table.END, 1)[0]


def test_every_record_entry_names_its_machine_and_what_it_saw():
    for entry in json.loads(record_table.RECORD.read_text()):
        assert all(entry.get(key) for key in MACHINE), entry.get("date")
        assert not entry["dry_run"], "a dry run ran on no GPU: it stays out of the record"
        assert "seen" in entry or {"notebooks", "steps"} <= entry.keys()


def test_the_gpu_plan_runs_every_lesson_notebook_twice_and_every_other_check():
    plan = steps.plan(pathlib.Path("/out"), dry_run=False)
    lessons = steps.lesson_notebooks()
    assert sorted(s.notebook for s in plan if s.kind == "nbval") == lessons
    assert sorted(s.notebook for s in plan if s.kind == "one_rank") == lessons
    assert all("--backend" in s.argv and "nccl" in s.argv for s in plan if s.kind == "one_rank")
    shared = [s for s in plan if s.kind == "nbval_shared_gpu"]
    assert sorted(s.notebook for s in shared) == [n for n in lessons if "_appendix_" not in n]
    assert all(dict(s.env) == {"COURSE_GLOO_ON_SHARED_GPU": "1"} for s in shared)
    assert {s.name for s in plan if s.notebook is None} == {
        "grader_solutions", "train_ddp", "train_fsdp", "train_2d", "doctor", "nccl_facts"}
    assert len({s.name for s in plan}) == len(plan)


def test_a_table_row_names_each_failure_with_its_cell_and_cause():
    entry = {"date": "2026-01-01", "gpu": "G", "torch": "t", "cuda": "c", "nccl": "n", "python": "p", "dry_run": False,
             "notebooks": {"05_fsdp2": {"nbval": {"cells_run": 9, "cells_failed": 1, "timed_out": False,
                                                   "failures": [{"cell": 4, "cause": "RuntimeError: boom"}]}}},
             "steps": {"doctor": {"rc": 1, "seconds": 3, "timed_out": False, "last_line": "verdict: not ready"}}}
    rows = record_table.rows(entry)
    assert "9 cells ran in 1 notebooks, 1 failed: 05_fsdp2 cell 4: RuntimeError: boom" in rows[0]
    assert "| same | `doctor` | exit 1 in 3 s: verdict: not ready |" in rows


@pytest.mark.slow
def test_the_dry_run_runs_every_kind_of_step_on_gloo_and_writes_an_entry(tmp_path):
    run = subprocess.run([sys.executable, str(GPU_NODE / "run_steps.py"), str(tmp_path), "--dry-run", "--jobs", "2",
                          "--notebooks", "00_setup", "--cells", "2", "--budget-s", "400"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    entry = json.loads((tmp_path / "record_entry.json").read_text())
    assert entry["dry_run"] and all(key in entry for key in MACHINE)
    lesson = entry["notebooks"]["00_setup"]
    assert (lesson["nbval"]["cells_run"], lesson["nbval"]["failures"]) == (2, []), lesson
    assert lesson["one_rank"]["backend"] == "gloo" and lesson["one_rank"]["cells_run"] >= 1, lesson
    assert lesson["one_rank"]["failures"] == [], lesson
    for name, step in entry["steps"].items():
        assert step["rc"] == 0, (name, step, (tmp_path / f"{name}.log").read_text()[-2000:])
    assert str(tmp_path) not in json.dumps(entry)
    assert record_table.rows(entry)[0].count("|") == 4


def test_the_script_names_the_shared_gpu_switch_as_course_lib_reads_it():
    from course_lib.backend_choice import ENV_GLOO_ON_SHARED_GPU

    assert steps.ENV_GLOO_ON_SHARED_GPU == ENV_GLOO_ON_SHARED_GPU
