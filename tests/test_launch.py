"""launch/: the lesson scripts run with plain torchrun, outside any notebook."""

import os
import pathlib
import subprocess
import sys

import pytest

from course_lib import choose_backend

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_run_local_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "launch" / "run_local.sh")], check=True)


def test_run_local_without_script_prints_usage():
    proc = subprocess.run(["bash", str(ROOT / "launch" / "run_local.sh")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage:")


@pytest.mark.parametrize("nproc", [2])
def test_hello_runs_under_plain_torchrun(nproc):
    env = dict(os.environ, NPROC=str(nproc), PYTHON=sys.executable)
    env.pop("COURSE_BACKEND", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "run_local.sh"), str(ROOT / "launch" / "scripts" / "hello.py")],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    # run_local.sh prefixes each whole line with its local rank: "[rank0]:..."
    lines = [line.split("]:", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[rank")]
    # Outside a notebook, rank 0 prints the backend header itself.
    assert choose_backend(nproc).header(nproc) in lines
    assert sorted(l for l in lines if l.startswith("hello")) == [
        f"hello from rank {r} of {nproc} on cpu" for r in range(nproc)
    ]
    assert f"all_reduce(SUM) = {nproc * (nproc + 1) // 2}, expected {nproc * (nproc + 1) // 2}: ok" in lines
    assert "OMP_NUM_THREADS" not in proc.stderr  # the launcher sets it, so torchrun does not warn


def test_make_lab_starts_jupyter_as_root_when_run_as_root():
    # Workshop containers and cloud notebooks run as root, where Jupyter refuses to start without --allow-root.
    dry = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    command = next(line for line in dry.stdout.splitlines() if "jupyter lab" in line)
    assert ("--allow-root" in command) == (os.geteuid() == 0)
