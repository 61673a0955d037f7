"""bench/ scripts run: each once in --smoke mode (every part, one round), so a change to what they
call or patch in course_lib breaks a test here, not the next person who measures. Numbers are not checked:
performance figures come from full runs (bench/README.md)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _smoke(script: str, *args: str, timeout_s: float) -> str:
    done = subprocess.run([sys.executable, f"bench/{script}", "--smoke", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_bench_simulate_runs():
    out = _smoke("bench_simulate.py", timeout_s=180)
    assert out.count("collectives/step") == 2


def test_why_cells_cost_runs():
    out = _smoke("why_cells_cost.py", timeout_s=300)
    assert "to_devnull" in out and "without both" in out


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="bench_cells watches exits with pidfds (Linux)")
def test_bench_cells_runs():
    out = _smoke("bench_cells.py", timeout_s=600)
    assert "one-shot 4 MiB all_reduce script" in out and "Where run_torchrun's time goes" in out


def test_bench_grading_runs():
    out = _smoke("bench_grading.py", timeout_s=300)
    assert "submissions/min" in out and "--jobs 2" in out
