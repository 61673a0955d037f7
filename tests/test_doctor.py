"""`python -m course_lib.doctor`: each check on good and bad facts, the verdict, the exit status.

The checks judge `Facts`; a test hands them another machine's facts (an old torch,
one core) without needing that machine. Two runs are real: this machine with its
cores cut to one (taskset's system call, so the exit status comes from the real
command), and a Python where `import torch` fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

from course_lib.doctor import checks
from course_lib.doctor.checks import BLOCKING, OK, WARN, Facts

ROOT = pathlib.Path(__file__).resolve().parents[1]


def good_facts(**changes) -> Facts:
    facts = Facts(python=(3, 11, 7), torch="2.13.0+cpu", distributed=True, backends={"gloo": True, "nccl": False},
                  gpus=[], cores=2, localhost="", packages={name: "1.0" for name in checks.JUPYTER_PACKAGES},
                  save_widget_state=True, settings_file="overrides.json", job="", job_s=4.0)
    return dataclasses.replace(facts, **changes)


def statuses(facts: Facts) -> dict[str, str]:
    return {finding.check: finding.status for finding in checks.judge(facts)}


def test_a_good_machine_is_ready_and_exits_0(capsys):
    assert set(statuses(good_facts()).values()) == {OK}
    assert checks.main([], facts=good_facts()) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "verdict: ready for the course (10 checks passed)"
    assert "what to do" not in out


@pytest.mark.parametrize("changes, check, status", [
    ({"python": (3, 9, 18)}, "python", BLOCKING),
    ({"torch": "2.12.1+cpu"}, "torch", BLOCKING),  # below the range
    ({"torch": "2.9.0a0+git1234"}, "torch", BLOCKING),
    ({"torch": "2.16.0"}, "torch", WARN),  # above what was tested: it should work
    ({"torch": "2.15.0+cu128"}, "torch", OK),
    ({"torch": None, "torch_error": "ModuleNotFoundError: No module named 'torch'", "job": None}, "torch", BLOCKING),
    ({"distributed": False, "backends": {}, "job": None}, "distributed", BLOCKING),
    ({"backends": {"gloo": False, "nccl": True}, "job": None}, "distributed", BLOCKING),
    ({"gpus": ["NVIDIA H100"], "backends": {"gloo": True, "nccl": False}}, "gpus", WARN),  # a GPU, no NCCL
    ({"gpus": ["NVIDIA H100"] * 2, "backends": {"gloo": True, "nccl": True}}, "gpus", OK),
    ({"cores": 1}, "cores", BLOCKING),  # too few cores
    ({"cores": 16}, "cores", OK),
    ({"localhost": "the name localhost does not resolve ([Errno -2] Name or service not known)"}, "ports", BLOCKING),
    ({"job": "did not finish within 120 s (ranks still running: [1])"}, "2-rank job", BLOCKING),
    ({"packages": {**good_facts().packages, "ipywidgets": None}}, "jupyter", BLOCKING),
    ({"save_widget_state": False}, "widget state", WARN),
    ({"save_widget_state": None}, "widget state", WARN),
    ({"launch_port": "port 29500 on 127.0.0.1 cannot be bound (Address already in use)"}, "launch port", WARN),
])
def test_each_check_names_the_problem_and_what_to_do(changes, check, status, capsys):
    facts = good_facts(**changes)
    findings = {finding.check: finding for finding in checks.judge(facts)}
    assert findings[check].status == status, findings[check]
    assert bool(findings[check].todo) == (status != OK)  # every problem says what to do
    exit_code = checks.main([], facts=facts)
    assert exit_code == (1 if status == BLOCKING else 0)
    lines = capsys.readouterr().out.splitlines()
    verdict = lines[-1]
    if status == BLOCKING:
        assert verdict.startswith("verdict: NOT READY: 1 blocking problem") and f"({check})" in verdict
    elif status == WARN:
        assert verdict == f"verdict: ready, with 1 warning ({check})"
    if status != OK:
        at = next(i for i, line in enumerate(lines) if line.split()[:2] == [status, check.split()[0]])
        assert "what to do:" in lines[at + 1]


def test_a_missing_torch_skips_the_checks_that_need_it():
    found = statuses(good_facts(torch=None, job=None))
    assert "distributed" not in found and "gpus" not in found and "2-rank job" not in found


def test_two_blocking_problems_are_both_named(capsys):
    assert checks.main([], facts=good_facts(torch="2.10.0", cores=1)) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "verdict: NOT READY: 2 blocking problems (torch, cores); fix them and run the doctor again")


def test_json_output(capsys):
    assert checks.main(["--json"], facts=good_facts(cores=1)) == 1
    reply = json.loads(capsys.readouterr().out)
    assert {f["check"]: f["status"] for f in reply["findings"]}["cores"] == BLOCKING
    assert reply["verdict"].startswith("verdict: NOT READY")


def test_the_constants_agree_with_the_course():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'requires-python = ">=(\d+)\.(\d+)"', text).groups() == tuple(map(str, checks.MIN_PYTHON))
    # The most ranks any lesson cell starts.
    counts = {int(n) for path in (ROOT / "notebooks").glob("*.ipynb")
              for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"
              for n in re.findall(r"^%%?(?:torchrun|dist start) -n (\d+)", cell.source, re.M)}
    assert max(counts) == checks.MAX_RANKS


def test_this_machine_reads_as_it_is():
    facts = checks.read_facts(run_job=False)
    import torch

    assert facts.torch == torch.__version__ and facts.backends["gloo"]
    quota = checks._cpu_quota(pathlib.Path("/sys/fs/cgroup"), pathlib.Path("/proc/self/cgroup"))
    assert facts.cores == min(len(os.sched_getaffinity(0)), quota or len(os.sched_getaffinity(0)))
    assert facts.localhost == ""
    assert all(facts.packages.values())
    assert facts.job is None  # not run


def _doctor(*args: str, preexec=None, python_code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", python_code] if python_code else [sys.executable, "-m", "course_lib.doctor"]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          preexec_fn=preexec, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.slow
def test_the_real_command_runs_its_2_rank_job_and_exits_0():
    done = _doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^  ok +2-rank job +a 2-rank gloo all_reduce gave 1 \+ 2 = 3 on both ranks", done.stdout, re.M)
    assert done.stdout.splitlines()[-1].startswith("verdict: ready")


def test_the_real_command_on_one_core_exits_1():
    done = _doctor("--no-job", preexec=lambda: os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}))
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^  BLOCKING cores +1 CPU core", done.stdout, re.M)
    assert done.stdout.splitlines()[-1].startswith("verdict: NOT READY: 1 blocking problem (cores)")


def test_the_real_command_without_torch_gives_its_verdict():
    # A fresh machine where torch is not installed (or does not import): the doctor still answers.
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'doctor'; "
            "runpy.run_module('course_lib.doctor', run_name='__main__')")
    done = _doctor("--no-job", python_code=code)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^  BLOCKING torch +torch cannot be imported", done.stdout, re.M)
    assert done.stdout.splitlines()[-1].startswith("verdict: NOT READY")


def test_a_failing_job_is_reported_with_the_ranks_last_error(monkeypatch):
    # The real launcher, a job whose rank 1 fails: the finding carries the rank's own last line.
    monkeypatch.setattr(checks, "JOB", "import os\nif os.environ['RANK'] == '1':\n"
                                       "    raise RuntimeError('gloo could not connect (made up)')\n")
    problem, _ = checks._run_job(timeout_s=120)
    assert problem.startswith("failed (exit codes") and "RuntimeError: gloo could not connect (made up)" in problem
    finding = checks.check_job(problem, 1.0)
    assert finding.status == BLOCKING and "GLOO_SOCKET_IFNAME" in finding.todo


@pytest.mark.parametrize("overrides, user, expected", [
    (None, None, False),  # jupyterlab_widgets' own default
    (True, None, True),  # make install's overrides.json
    (True, "{\n  // the learner turned it off\n  \"saveState\": false\n}", False),  # Settings > Jupyter Widgets
    (False, "{\"saveState\": true}", True),
])
def test_widget_state_is_read_as_jupyterlab_reads_it(tmp_path, monkeypatch, overrides, user, expected):
    from jupyterlab_server.settings_utils import get_settings

    app, user_dir = tmp_path / "app", tmp_path / "user"
    monkeypatch.setenv("JUPYTERLAB_DIR", str(app))
    monkeypatch.setenv("JUPYTERLAB_SETTINGS_DIR", str(user_dir))
    if overrides is not None:
        (app / "settings").mkdir(parents=True)
        (app / "settings" / "overrides.json").write_text(json.dumps({checks.WIDGET_PLUGIN: {"saveState": overrides}}))
    if user is not None:
        path = user_dir / "@jupyter-widgets" / "jupyterlab-manager" / "plugin.jupyterlab-settings"
        path.parent.mkdir(parents=True)
        path.write_text(user)
    labextensions = os.path.join(sys.prefix, "share", "jupyter", "labextensions")
    found, _ = get_settings(str(app / "settings"), str(app / "schemas"), str(user_dir),
                            schema_name=checks.WIDGET_PLUGIN, labextensions_path=[labextensions])
    seen_by_jupyterlab = found["settings"].get("saveState", found["schema"]["properties"]["saveState"]["default"])
    assert seen_by_jupyterlab is expected
    found_user = str(path) if user is not None else ""
    assert checks._widget_state_setting() == (expected, str(app / "settings" / "overrides.json"), found_user)
    if user is not None and not expected:  # the learner's own setting: the course's overrides.json cannot help
        todo = checks.check_widget_state(expected, "overrides.json", found_user).todo
        assert "beats the course's overrides.json" in todo and "lab_settings" not in todo


def test_json_prints_json_only_from_the_real_command():
    done = _doctor("--json", "--no-job")
    reply = json.loads(done.stdout)  # the whole of stdout: no header line before it
    assert {f["check"] for f in reply["findings"]} >= {"cores", "launch port", "widget state"}


@pytest.mark.parametrize("limits, expected", [
    ({"cpu.max": "max 100000", "course.slice/cpu.max": "150000 100000"}, 2),  # 1.5 cores' quota: 2 cores
    ({"cpu.max": "100000 100000", "course.slice/cpu.max": "max 100000"}, 1),  # an ancestor's quota counts
    ({"cpu.max": "max 100000"}, None),  # no quota
    ({}, None),  # no cgroup v2 files at all
])
def test_cpu_quota_is_read_from_cgroup_v2_along_the_own_cgroups_path(tmp_path, limits, expected):
    root = tmp_path / "cgroup"
    (root / "course.slice" / "learner.scope").mkdir(parents=True)
    for where, text in limits.items():
        (root / where).write_text(text + "\n")
    own = tmp_path / "self_cgroup"
    own.write_text("0::/course.slice/learner.scope\n")
    assert checks._cpu_quota(root, own) == expected
    cores = checks._cores(root, own)
    assert cores == min(len(os.sched_getaffinity(0)), expected or 10**6)


def test_a_taken_launch_port_is_named():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        problem = checks._launch_port(port)
    assert problem.startswith(f"port {port} on 127.0.0.1 cannot be bound"), problem
    assert checks._launch_port(port) == ""  # free again
